"""Admin routes: POST /v1/models/load and POST /v1/models/unload (switch the served model without a restart).

What a request may name is deliberately narrow: a catalog id (models.yaml) that is already on this machine, or
an absolute path to an existing local model folder (one with a config.json; no '..' components). Nothing from
the request reaches a shell, and the API never starts a download or a quantization build (use
``python app.py fetch`` or the UI's Models tab for that). Local folders are refused when the server listens on a
non-loopback address without an API key, so a server exposed to a network cannot be made to read arbitrary
folders. Both routes sit under /v1, so ``--api-key`` protects them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from engine.async_engine import AsyncEngine
from engine.catalog import Catalog, resolve_model
from engine.errors import EngineError
from engine.serving import protocol as p
from engine.serving.errors import APIError

log = logging.getLogger("pagoda.server")


def check_model_reference(model: str, allow_local_paths: bool) -> str:
    """Validate what a load request names; return the string to hand to the engine (id or resolved folder)."""
    catalog = Catalog.load()
    if catalog.get(model) is not None:
        resolve_model(model, catalog, auto_fetch_bundled=False, log=log.info)  # raises if not on this machine
        return model
    if any(c in model for c in "\x00\r\n"):
        raise APIError(400, "the model name contains control characters", "model", "invalid_model")
    path = Path(model)
    if not path.is_absolute():
        known = ", ".join(sorted(catalog.entries))
        raise APIError(404, f"unknown model '{model}': not a catalog id ({known}) nor an absolute folder path",
                       "model", "model_not_found")
    if not allow_local_paths:
        raise APIError(403, "loading local folders is disabled on a server that listens on a network address "
                       "without --api-key; use a catalog id", "model", "local_paths_disabled")
    if ".." in path.parts:
        raise APIError(400, "model folder paths must not contain '..'", "model", "invalid_model")
    try:
        is_model = path.is_dir() and (path / "config.json").is_file()
    except OSError:  # name too long, permission denied...
        is_model = False
    if not is_model:
        raise APIError(404, f"{path} is not a model folder (an existing folder with a config.json)", "model",
                       "model_not_found")
    return str(path.resolve())


def build_router(engine: AsyncEngine, allow_local_paths: bool) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/models/load", responses={400: {"model": p.ErrorResponse}, 404: {"model": p.ErrorResponse}})
    async def load_model(req: p.LoadModelRequest) -> JSONResponse:
        """Load a model and serve it; returns when it serves. On failure the previous model keeps serving."""
        target = check_model_reference(req.model, allow_local_paths)
        try:
            info = await engine.switch_model(target, **req.engine_overrides())
        except EngineError as exc:  # the model's problem (bad folder, unsupported, will not fit): a 400
            raise APIError(400, f"{exc.message}; {engine.model_name or 'no model'} is serving",
                           exc.param or "model", exc.code or "load_failed") from exc
        except Exception as exc:  # out of memory, a corrupt file the loader did not anticipate...
            log.exception("loading %s failed", req.model)
            raise APIError(500, f"loading {req.model} failed: {type(exc).__name__}: {exc}; "
                           f"{engine.model_name or 'no model'} is serving", "model", "load_failed") from exc
        return JSONResponse({"object": "model", "id": info.model, "status": "loaded",
                             "max_model_len": info.max_model_len, "load_seconds": round(info.load_seconds, 3),
                             "previous": info.previous})

    @router.post("/v1/models/unload")
    async def unload_model() -> JSONResponse:
        """Stop serving and free the model's memory; in-flight requests end with a 503 error."""
        name = await engine.unload()
        return JSONResponse({"object": "model", "id": name, "status": "unloaded" if name else "not_loaded"})

    return router
