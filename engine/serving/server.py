"""Builds the FastAPI app that serves the OpenAI API, the admin routes and /metrics around one engine.

With a key, ``access.AccessGuard`` stands in front of every path but /health (the UI that ``app.py`` mounts
at "/" included). The API paths also sit behind ``APIGuard``, which runs before any body parsing: a refusal
of cross-site browser requests (403) so a web page cannot drive the local API, and a body size limit (413).
The UI is not imported here: the caller passes a ``mount`` callable (``app.py`` mounts the Gradio UI).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.metrics import CONTENT_TYPE
from engine.serving import access, admin_routes, openai_routes
from engine.serving.errors import APIError, install_error_handlers, send_error

log = logging.getLogger("pagoda.server")

MAX_BODY_BYTES = 4 * 1024 * 1024
API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def pagoda_version() -> str:
    try:
        from importlib.metadata import version

        return version("pagoda")
    except Exception:  # noqa: BLE001 -- not installed, broken metadata
        return "0.0.0+local"


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 7860
    max_body_bytes: int = MAX_BODY_BYTES

    @property
    def private(self) -> bool:
        """Only this machine (loopback) or holders of the key can reach the server."""
        return bool(self.api_key) or is_loopback(self.host)

    @property
    def allow_local_paths(self) -> bool:
        """Load local folders by path only on a private server."""
        return self.private

    @property
    def allow_downloads(self) -> bool:
        """Start Hub downloads, builds and model adds (the UI's Models tab) only on a private server; the API
        never starts one."""
        return self.private


class BodyTooLarge(StarletteHTTPException):
    """Raised from the guarded ``receive`` when a streamed body passes the limit (FastAPI re-raises HTTP errors)."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than {limit} bytes")


class APIGuard:
    """ASGI middleware on the API paths: cross-site refusal, body size limit. Other paths pass through."""

    def __init__(self, app, settings: ServerSettings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = self._check(headers)
        if error is not None:
            await send_error(send, error)
            return
        limit = self.settings.max_body_bytes
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)

    def _check(self, headers: dict[str, str]) -> APIError | None:
        origin = headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != headers.get("host", ""):
            return APIError(403, "cross-origin browser requests to the API are refused", None, "cross_origin")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "invalid Content-Length header", None, "invalid_request")
            if int(length) > self.settings.max_body_bytes:
                return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.settings.max_body_bytes} bytes", None,
                        "request_too_large")


Mount = Callable[[FastAPI], object]


def build_app(engine: AsyncEngine, settings: ServerSettings, mount: Mount | None = None,
              owns_engine: bool = True) -> FastAPI:
    """The app around an existing AsyncEngine (tests and embedding use this; ``build_server`` loads first).

    ``mount(app)`` puts a front end at "/" after the API routes (``app.state`` holds the engine, the settings and,
    with a key, the ``KeyAccess`` to hand to it); without one, "/" answers a JSON pointer to the API.
    ``owns_engine``: shut the engine down (free the model) when the app stops."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if owns_engine:
            engine.shutdown()

    version = pagoda_version()
    app = FastAPI(title="Pagoda", version=version, lifespan=lifespan,
                  description="OpenAI-compatible API of a local paged-KV continuous-batching engine.")
    app.state.engine = engine
    app.state.settings = settings
    app.state.access = access.KeyAccess(settings.api_key) if settings.api_key else None
    install_error_handlers(app)

    app.include_router(openai_routes.build_router(engine, fingerprint=f"pagoda-{version}"))
    app.include_router(admin_routes.build_router(engine, settings.allow_local_paths))
    if app.state.access is not None:
        app.include_router(access.build_router(app.state.access))

    @app.get("/health")
    async def health() -> JSONResponse:
        snapshot = engine.snapshot()
        return JSONResponse({"status": "ok", "model": snapshot.model_name if snapshot else None,
                             "loading": engine.loading_model})

    @app.get("/version")
    async def get_version() -> JSONResponse:
        return JSONResponse({"version": version})

    @app.get("/metrics")
    async def metrics() -> Response:
        # In a thread: the scrape may wait a moment for the engine loop to refresh an old memory report.
        return Response(await asyncio.to_thread(engine.metrics.render), media_type=CONTENT_TYPE)

    app.add_middleware(APIGuard, settings=settings)
    if app.state.access is not None:  # added last: runs first
        app.add_middleware(access.AccessGuard, access=app.state.access, api_prefixes=API_PREFIXES)
    if mount is not None:
        mount(app)
    else:
        @app.get("/", include_in_schema=False)
        async def index() -> JSONResponse:
            return JSONResponse({"name": "Pagoda", "model": engine.model_name, "api": "/v1", "docs": "/docs"})
    return app


def build_server(args: EngineArgs, api_key: str | None = None, host: str = "127.0.0.1", port: int = 7860,
                 max_body_bytes: int = MAX_BODY_BYTES, mount: Mount | None = None) -> FastAPI:
    """Load the model first (so the port opens only when it serves), then return the app (see ``build_app``)."""
    if not api_key and not is_loopback(host):
        log.warning("listening on %s without an API key: anyone who can reach this port can use the model", host)
    engine = AsyncEngine(args)
    return build_app(engine, ServerSettings(api_key or None, host, port, max_body_bytes), mount=mount)


class ServerThread:
    """uvicorn in a background thread (tests, notebooks): ``with ServerThread(app, port) as url: ...``."""

    def __init__(self, app: FastAPI, port: int, host: str = "127.0.0.1"):
        import uvicorn

        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
