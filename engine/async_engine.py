"""AsyncEngine: one served model at a time behind an asyncio API, and switching between models.

Why this layer: servers and the UI need requests that stream and cancel, and a model they can replace without a
restart. Requests go to the model's ``EngineLoop`` (engine/engine_loop.py: the thread that alone steps the
LLMEngine) and come back as ``RequestStream`` outputs (engine/streams.py); what the engine is doing is read from
the loop's published ``EngineSnapshot`` (engine/snapshot.py). This module owns which loop serves.

Cancellation: ``generate`` is an async generator; when its consumer is cancelled (client disconnect), closes it
(``aclose``) or stops iterating, its ``finally`` queues an abort, and the loop thread frees the request's KV blocks
before its next step.

Switching: the new LLMEngine is built (in the caller's worker thread) while the old one keeps serving. If the build
fails the old one is untouched. If it succeeds the new loop starts, the old loop fails its in-flight streams with
``ModelSwitchedError`` and releases its memory. ``release_first=True`` (the default on CUDA, where two models rarely
fit one memory budget) frees the old model before loading and reloads it if the new one fails.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from engine.admission import Admission
from engine.config import EngineArgs, resolve_device
from engine.engine_loop import EngineLoop
from engine.errors import (
    EngineError,
    EngineStepError,
    EngineUnavailableError,
    ModelSwitchedError,
    NoModelLoadedError,
)
from engine.request import RequestOutput, SamplingParams
from engine.snapshot import EngineSnapshot
from engine.streams import OutputChannel, RequestStream

log = logging.getLogger("pagoda.async_engine")

ModelLoader = Callable[[EngineArgs], "object"]  # EngineArgs -> an LLMEngine (or a test double with its API)


def check_model_folder(model: str) -> None:
    """Cheap checks of a model reference before anything is unloaded: a catalog id, or a folder whose
    config.json names a supported architecture. Raises EngineError."""
    from engine.catalog import Catalog
    from engine.config import ModelConfig

    if Catalog.load().get(model) is not None:
        return
    path = Path(model).expanduser()
    if not path.is_dir():
        raise EngineError(f"unknown model {model!r}: not a catalog id nor a local folder", param="model")
    ModelConfig.from_path(path)


def _free_memory(device_type: str) -> None:
    """Give freed tensors back: cycles first (the model graph has some), then the CUDA caching allocator, then
    glibc's heap: weights freed by a loop thread stay in its malloc arena (hundreds of MB of RSS per switch)
    until ``malloc_trim`` returns them to the OS."""
    gc.collect()
    if device_type == "cuda":
        import torch

        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def _default_loader(args: EngineArgs):
    from engine.llm_engine import LLMEngine

    return LLMEngine(args)


@dataclass(frozen=True)
class LoadInfo:
    """What ``switch_model`` did: the model now serving and how long the load took."""

    model: str
    max_model_len: int
    load_seconds: float
    previous: str | None


class AsyncEngine:
    """One served model at a time behind an asyncio API; safe to call from any event loop or thread."""

    def __init__(self, engine_args: EngineArgs | None = None, *, model_loader: ModelLoader | None = None,
                 load: bool = True):
        """``load=False`` starts with no model (``engine_args`` then only seeds later loads' defaults)."""
        from engine.metrics import EngineMetrics

        self._loader: ModelLoader = model_loader or _default_loader
        self._base_args = engine_args or EngineArgs()  # server defaults (the command line) for later loads
        self._args = self._base_args
        self._switch_lock = threading.Lock()
        self._worker: EngineLoop | None = None
        self._loading: str | None = None
        self.metrics = EngineMetrics(self)
        if load:
            self._worker = self._start(self._args)

    # ---- what is served ---------------------------------------------------------------------------------
    @property
    def is_loaded(self) -> bool:
        return self._worker is not None

    @property
    def loading_model(self) -> str | None:
        """The model being loaded right now, or None."""
        return self._loading

    @property
    def model_name(self) -> str | None:
        worker = self._worker
        return worker.model_name if worker else None

    @property
    def engine_args(self) -> EngineArgs:
        """The arguments of the served model (or of the last one, when nothing is loaded)."""
        return self._args

    @property
    def tokenizer(self):
        return self._require_worker().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._require_worker().max_model_len

    @property
    def vocab_size(self) -> int:
        return self._require_worker().vocab_size

    @property
    def admission(self) -> Admission:
        """The served model's admission rules (engine/admission.py): what the API and the UI check first."""
        return self._require_worker().admission

    @property
    def loaded_at(self) -> float | None:
        """Unix time when the served model started serving."""
        worker = self._worker
        return worker.loaded_at if worker else None

    @property
    def model_dir(self) -> Path | None:
        """The folder the served model was loaded from."""
        worker = self._worker
        return worker.model_dir if worker else None

    @property
    def llm_engine(self):
        """The served LLMEngine, for tests and debugging only: its loop thread owns it (other threads read
        ``snapshot()``)."""
        worker = self._worker
        return worker.engine if worker else None

    def snapshot(self, max_memory_age: float | None = None, wait: float = 0.0) -> EngineSnapshot | None:
        """The served engine as of its last step (engine/snapshot.py), or None when nothing serves. A memory
        report older than ``max_memory_age`` seconds is refreshed, waiting ``wait`` seconds at most for it."""
        worker = self._worker
        return worker.snapshot(max_memory_age, wait) if worker else None

    def stats(self) -> dict:
        """The engine's counters as of its last step, plus what is served. Empty counters when unloaded."""
        worker = self._worker
        snapshot = worker.snapshot() if worker else None
        stats = snapshot.stats() if snapshot else {}
        stats.update(model_name=worker.model_name if worker else None, loading=self._loading,
                     max_model_len=worker.max_model_len if worker else None)
        return stats

    def _require_worker(self) -> EngineLoop:
        worker = self._worker
        if worker is None:
            raise NoModelLoadedError(f"no model loaded (loading {self._loading})" if self._loading else
                                     NoModelLoadedError().message)
        return worker

    # ---- requests ---------------------------------------------------------------------------------------
    async def add_request(self, request_id: str | None = None, prompt: str | None = None,
                          params: SamplingParams | None = None, *, prompt_token_ids: list[int] | None = None,
                          model: str | None = None, prompt_param: str = "prompt") -> RequestStream:
        """Queue a request and wait until the engine accepted it; iterate the returned stream for outputs.

        ``model``: the model the caller tokenized for; if another one serves by now, ModelSwitchedError.
        ``prompt_param``: the caller's field the prompt came from, named by an admission refusal.
        Raises EngineError (bad input: 4xx) or NoModelLoadedError / ModelSwitchedError (503) here, before
        any output, so a server can still answer with a plain error status.
        """
        worker = self._require_worker()
        if model is not None and model != worker.model_name:
            raise ModelSwitchedError(f"model switched to {worker.model_name}")
        params = params or SamplingParams()
        worker.admission.check_params(params)
        request_id = request_id or uuid.uuid4().hex
        stream = OutputChannel(asyncio.get_running_loop())
        timing = self.metrics.start_request(worker.model_name)
        worker.submit_add(request_id, prompt, prompt_token_ids, params, stream, prompt_param)
        try:
            await stream.added
        except asyncio.CancelledError:
            worker.abort(request_id)  # queued after the add: the loop thread drops it right away
            raise
        return RequestStream(worker, request_id, stream, timing)

    async def generate(self, prompt: str | None = None, params: SamplingParams | None = None,
                       request_id: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       prompt_param: str = "prompt") -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative text/token ids per sample) until it finishes.

        Raises EngineError (bad input, before the first output), NoModelLoadedError, ModelSwitchedError or
        EngineStepError (mid-stream). Cancelling or closing the iterator aborts the request at once; use
        ``contextlib.aclosing`` so that also happens when the consumer stops early.
        """
        stream = await self.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids,
                                        prompt_param=prompt_param)
        async with stream:
            async for output in stream:
                yield output

    # ---- switching --------------------------------------------------------------------------------------
    async def switch_model(self, model: str, *, release_first: bool | None = None, **engine_args) -> LoadInfo:
        """Load ``model`` (catalog id or local folder); ``engine_args`` override the server's defaults.

        Returns once the new model serves. On failure the previous model keeps serving and the error is raised.
        """
        return await asyncio.to_thread(self.switch_model_sync, model, release_first=release_first, **engine_args)

    def switch_model_sync(self, model: str, *, release_first: bool | None = None, **engine_args) -> LoadInfo:
        with self._switch_lock:
            # Unset arguments come from the server's defaults; the context length is the new model's own.
            args = replace(self._base_args, model=model, max_model_len=None).with_overrides(**engine_args)
            old = self._worker
            if release_first is None:
                release_first = old is not None and resolve_device(args.device).type == "cuda"
            if release_first and old is not None:
                check_model_folder(model)  # fail fast on an obvious mistake before dropping the served model
            self._loading = model
            try:
                if release_first and old is not None:
                    self._retire(old, ModelSwitchedError(f"model {old.model_name} was unloaded to load {model}"))
                started = time.monotonic()
                try:
                    new = self._start(args)
                except BaseException:
                    if release_first and old is not None:
                        self._restore(old.args)
                    raise
                self._args = args
                if old is not None and not release_first:
                    self._retire(old, ModelSwitchedError(f"model switched to {new.model_name}"))
                log.info("now serving %s (loaded in %.1f s)", new.model_name, time.monotonic() - started)
                return LoadInfo(new.model_name, new.max_model_len, time.monotonic() - started,
                                old.model_name if old else None)
            finally:
                self._loading = None

    async def unload(self) -> str | None:
        """Stop serving: in-flight requests end with an error, memory is freed. Returns the unloaded model."""
        return await asyncio.to_thread(self.unload_sync)

    def unload_sync(self) -> str | None:
        with self._switch_lock:
            old = self._worker
            if old is None:
                return None
            self._retire(old, NoModelLoadedError(f"model {old.model_name} was unloaded"))
            return old.model_name

    def shutdown(self) -> None:
        """End the loop thread and free the model (server shutdown). Safe to call twice."""
        with self._switch_lock:
            if self._worker is not None:
                self._retire(self._worker, EngineUnavailableError("the server is shutting down", "shutdown"))

    def _start(self, args: EngineArgs) -> EngineLoop:
        engine = self._loader(args)
        try:
            worker = EngineLoop(engine, args)
        except EngineStepError:  # its warm-up failed: nothing serves this engine
            engine.release()
            raise
        self._worker = worker
        return worker

    def _retire(self, worker: EngineLoop, error: BaseException) -> None:
        if self._worker is worker:
            self._worker = None
        worker.stop(error)
        worker.thread.join()
        _free_memory(resolve_device(worker.args.device).type)

    def _restore(self, args: EngineArgs) -> None:
        """After a failed load in release-first mode: bring the previous model back (best effort)."""
        try:
            self._start(args)
        except Exception:
            log.exception("could not reload the previous model %s", args.model)

