"""The engine loop in a background thread, asyncio streams per request, abort on cancel, and model switching.

Why a thread: ``LLMEngine.step()`` is blocking torch work. Running it on the event loop would freeze every
HTTP connection (and the UI) for the length of a step, so one thread per loaded model owns its LLMEngine and
is the only code that ever touches it. Everything else talks to that thread through an ordered queue of typed
commands (``AddRequest``, ``AbortRequest``, ``RefreshSnapshot``, ``Stop``) guarded by a condition variable; the
thread sleeps on the condition when there is nothing to do, so an idle server burns no CPU. After each step the
thread publishes a frozen ``EngineSnapshot`` (engine/snapshot.py): the only thing other threads read.

Outputs travel back with ``loop.call_soon_threadsafe``. ``RequestOutput`` text and token ids are cumulative,
so a stream keeps only the newest output (a slow consumer never grows a queue: it just sees bigger deltas);
``DeltaTracker`` turns cumulative outputs into per-sample deltas for SSE.

Cancellation: ``generate`` is an async generator; when its consumer is cancelled (client disconnect), closes
it (``aclose``) or stops iterating, its ``finally`` queues an abort, and the loop thread frees the request's
KV blocks before its next step.

Switching: the new LLMEngine is built (in the caller's worker thread) while the old one keeps serving. If the
build fails the old one is untouched. If it succeeds the new loop starts, the old loop fails its in-flight
streams with ``ModelSwitchedError`` and releases its memory. ``release_first=True`` (the default on CUDA,
where two models rarely fit one memory budget) frees the old model before loading and reloads it if the new
one fails.
"""

from __future__ import annotations

import asyncio
import copy
import ctypes
import gc
import logging
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.config import EngineArgs, resolve_device
from engine.request import EngineError, Logprob, RequestOutput, SamplingParams
from engine.sampler import validate_for_vocab
from engine.snapshot import EngineSnapshot, MemorySnapshot

log = logging.getLogger("pagoda.async_engine")

ModelLoader = Callable[[EngineArgs], "object"]  # EngineArgs -> an LLMEngine (or a test double with its API)


class EngineUnavailableError(RuntimeError):
    """The request cannot be served right now (HTTP 503): no model, a switch, a shutdown."""

    def __init__(self, message: str, code: str = "engine_unavailable"):
        super().__init__(message)
        self.message = message
        self.code = code


class ModelSwitchedError(EngineUnavailableError):
    """The model serving this request was replaced; the request was aborted."""

    def __init__(self, message: str):
        super().__init__(message, code="model_switched")


class NoModelLoadedError(EngineUnavailableError):
    def __init__(self, message: str = "no model loaded: load one with POST /v1/models/load or from the UI"):
        super().__init__(message, code="no_model_loaded")


class EngineStepError(RuntimeError):
    """The engine failed while running this request (a bug, or the device failed); it was aborted."""


# ---- per-sample deltas ---------------------------------------------------------------------------------------
@dataclass
class SampleDelta:
    """What one sample gained since the last output: new text, token ids and logprobs; set when it finished."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class DeltaTracker:
    """Turns cumulative RequestOutputs into per-sample deltas (for streaming). One tracker per request."""

    _seen: dict[int, tuple[int, int, int, bool]] = field(default_factory=dict)  # index -> (chars, tokens, lps, done)

    def update(self, output: RequestOutput) -> list[SampleDelta]:
        deltas = []
        for sample in output.outputs:
            chars, tokens, lps, done = self._seen.get(sample.index, (0, 0, 0, False))
            if done:
                continue
            finished = sample.finish_reason is not None
            new_tokens = sample.token_ids[tokens:]
            if not new_tokens and len(sample.text) == chars and not finished:
                continue
            new_lps = sample.logprobs[lps:] if sample.logprobs is not None else None
            deltas.append(SampleDelta(sample.index, sample.text[chars:], list(new_tokens), new_lps,
                                      sample.finish_reason, sample.stop_reason))
            self._seen[sample.index] = (len(sample.text), len(sample.token_ids),
                                        len(sample.logprobs or ()), finished)
        return deltas


# ---- one request's stream ------------------------------------------------------------------------------------
class _Stream:
    """The consumer side of one request: the newest output or an error, handed over from the loop thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.added: asyncio.Future = loop.create_future()
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    # Called on the event loop (scheduled from the engine thread).
    def _set_added(self, error: BaseException | None) -> None:
        if self.added.done():
            return
        if error is None:
            self.added.set_result(None)
        else:
            self.added.set_exception(error)

    def _put(self, output: RequestOutput) -> None:
        self.latest = output
        self.ready.set()

    def _fail(self, error: BaseException) -> None:
        self._set_added(error)
        self.error = error
        self.ready.set()

    # Called from the engine thread.
    def post(self, fn: Callable, arg) -> bool:
        try:
            self.loop.call_soon_threadsafe(fn, arg)
            return True
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            return False

    async def next(self) -> RequestOutput:
        await self.ready.wait()
        self.ready.clear()
        if self.error is not None:
            raise self.error
        output, self.latest = self.latest, None
        return output


# ---- commands to the loop thread -----------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """Admit a request; the engine's answer (accepted, or the EngineError) goes to ``stream.added``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: _Stream


@dataclass(frozen=True)
class AbortRequest:
    """End a request and free its KV blocks before the next step (unknown or finished ids: no-op)."""

    request_id: str


@dataclass(frozen=True)
class RefreshSnapshot:
    """Publish a snapshot with a fresh memory report now (a reader found it old while the loop was idle)."""


@dataclass(frozen=True)
class Stop:
    """Fail every in-flight request with the closing error, release the engine and end the thread."""


Command = AddRequest | AbortRequest | RefreshSnapshot | Stop

MEMORY_REFRESH_SECONDS = 0.5  # while stepping, the memory report is re-read at most this often


# ---- the loop thread of one loaded model ---------------------------------------------------------------------
class _Worker:
    """Owns one LLMEngine and the thread that steps it. Only that thread calls the engine after construction;
    other threads read ``snapshot()`` (engine/snapshot.py), replaced after every step."""

    def __init__(self, engine, args: EngineArgs):
        self.engine = engine
        self.args = args
        self.model_name: str = engine.model_name
        self.model_dir = getattr(engine, "model_dir", None)
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        config = getattr(engine, "model_config", None)
        self.vocab_size: int = getattr(config, "vocab_size", None) or self.tokenizer.vocab_size
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._closed_error: BaseException | None = None  # set once stop is requested
        self._snapshot: EngineSnapshot | None = None  # replaced (never mutated) by the loop thread
        self._memory: MemorySnapshot | None = None  # loop thread only
        self._num_steps = 0  # loop thread only
        self._refresh_pending = False
        self.loaded_at = time.time()
        self._warmed_up = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"pagoda-engine-{self.model_name}-{id(self):x}",
                                       daemon=True)
        self.thread.start()
        self._warmed_up.wait()  # the model serves once its loop thread has warmed up (engine/warmup.py)
        if self._closed_error is not None:
            raise copy.copy(self._closed_error)

    # ---- any thread -------------------------------------------------------------------------------------
    def submit_add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                   params: SamplingParams, stream: _Stream) -> None:
        self._push(AddRequest(request_id, prompt, prompt_token_ids, params, stream))

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._closed_error is None:
                self._commands.append(AbortRequest(request_id))
                self._cond.notify()

    def stop(self, error: BaseException) -> None:
        """Fail every in-flight and queued request with ``error``, release the engine, end the thread."""
        with self._cond:
            if self._closed_error is None:
                self._closed_error = error
                self._commands.append(Stop())
                self._cond.notify()

    def snapshot(self, max_memory_age: float | None = None, wait: float = 0.0) -> EngineSnapshot | None:
        """The latest snapshot (None once stopped). With ``max_memory_age``, a memory report older than that
        makes the loop publish a fresh one; ``wait`` seconds at most are spent waiting for it (an idle loop
        answers at once; a busy one refreshes on its own every MEMORY_REFRESH_SECONDS)."""
        snapshot = self._snapshot
        if snapshot is None or max_memory_age is None:
            return snapshot
        memory = snapshot.memory
        if memory is not None and time.monotonic() - memory.taken_at <= max_memory_age:
            return snapshot
        with self._cond:
            if self._closed_error is not None:
                return self._snapshot
            if not self._refresh_pending:
                self._refresh_pending = True
                self._commands.append(RefreshSnapshot())
                self._cond.notify()
            if wait > 0:
                self._cond.wait_for(lambda: self._snapshot is not snapshot or self._closed_error is not None,
                                    timeout=wait)
        return self._snapshot

    def _push(self, command: Command) -> None:
        with self._cond:
            if self._closed_error is not None:
                raise copy.copy(self._closed_error)  # one instance per raise: tracebacks must not pile up
            self._commands.append(command)
            self._cond.notify()

    # ---- the loop thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._warm_up()
            self._loop()
        except BaseException as exc:  # never leave callers waiting on a dead thread
            log.exception("the engine loop of %s crashed", self.model_name)
            with self._cond:
                self._closed_error = self._closed_error or EngineStepError(f"the engine loop crashed: {exc!r}")
            self._fail_all()
            self._publish_none()

    def _warm_up(self) -> None:
        """Warm the engine up from this thread (engine/warmup.py) and publish the first snapshot; a failure
        closes the worker before the constructor, waiting on ``_warmed_up``, looks."""
        try:
            warm_up = getattr(self.engine, "warm_up", None)
            if warm_up is not None:  # test doubles of the engine have none
                warm_up()
            self._publish(refresh_memory=True)
        except BaseException as exc:
            with self._cond:
                self._closed_error = EngineStepError(f"warming up {self.model_name} failed: {exc!r}")
            raise
        finally:
            self._warmed_up.set()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._commands and not self.engine.has_unfinished_requests():
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
            refresh = self._apply(commands)
            if refresh is None:
                return
            stepped = self.engine.has_unfinished_requests()
            outputs = self._step() if stepped else []
            self._num_steps += stepped
            self._publish(refresh_memory=refresh)  # before delivery: a finished stream sees its own effect
            self._deliver(outputs)

    def _apply(self, commands: list[Command]) -> bool | None:
        """Run queued commands in order. None when the worker must stop, else whether a fresh memory report
        was asked for."""
        refresh = False
        for command in commands:
            match command:
                case AddRequest():
                    self._add(command)
                case AbortRequest(request_id):
                    self._abort(request_id)
                case RefreshSnapshot():
                    refresh = True
                case Stop():
                    self._shutdown()
                    return None
        return refresh

    def _publish(self, refresh_memory: bool = False) -> None:
        """Build this step's snapshot and swap it in (one reference assignment: readers see old or new)."""
        now = time.monotonic()
        if refresh_memory or self._memory is None or now - self._memory.taken_at >= MEMORY_REFRESH_SECONDS:
            self._memory = self._read_memory(now)
        snapshot = self.engine.snapshot(step=self._num_steps, memory=self._memory)
        with self._cond:
            self._snapshot = snapshot
            self._refresh_pending = False
            self._cond.notify_all()

    def _publish_none(self) -> None:
        with self._cond:
            self._snapshot = None
            self._refresh_pending = False
            self._cond.notify_all()

    def _read_memory(self, now: float) -> MemorySnapshot | None:
        try:
            return MemorySnapshot(self.engine.memory_report(), now)
        except Exception:  # an optional figure: the snapshot goes out without it
            log.debug("memory report failed", exc_info=True)
            return None

    def _add(self, command: AddRequest) -> None:
        stream = command.stream
        try:
            self.engine.add_request(command.request_id, prompt=command.prompt,
                                    prompt_token_ids=command.prompt_token_ids, params=command.params)
        except Exception as exc:  # noqa: BLE001 -- EngineError for bad input; anything else goes to the caller too
            stream.post(stream._set_added, exc)
            return
        self._streams[command.request_id] = stream
        if not stream.post(stream._set_added, None):
            self._abort(command.request_id)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as exc:  # a bug or a device failure: fail the requests, keep the loop alive
            log.exception("engine step failed; aborting %d request(s)", len(self._streams))
            error = EngineStepError(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
            for request_id, stream in list(self._streams.items()):
                stream.post(stream._fail, copy.copy(error))
                self._abort(request_id)
            return []

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            if not stream.post(stream._put, output) and not output.finished:
                self._abort(output.request_id)

    def _shutdown(self) -> None:
        self._fail_all()
        try:
            self.engine.release()
        except Exception:
            log.exception("releasing %s failed", self.model_name)
        self._publish_none()
        self.engine = None  # drop the last reference from this thread

    def _fail_all(self) -> None:
        """End queued adds and in-flight requests with the closing error (each stream its own copy)."""
        with self._cond:
            leftovers = list(self._commands)
            self._commands.clear()
        error = self._closed_error
        for command in leftovers:  # adds that raced with the stop
            if isinstance(command, AddRequest):
                command.stream.post(command.stream._fail, copy.copy(error))
        for request_id, stream in list(self._streams.items()):
            stream.post(stream._fail, copy.copy(error))
            try:
                self._abort(request_id)
            except Exception:  # noqa: BLE001 -- the engine may be what failed; the streams are told already
                self._streams.pop(request_id, None)


class RequestStream:
    """The outputs of one accepted request. Leaving it early (``aclose``, ``async with``, cancellation, garbage
    collection) aborts the request, which frees its KV blocks before the engine's next step."""

    def __init__(self, worker: _Worker, request_id: str, stream: _Stream, timing):
        self.request_id = request_id
        self.model_name = worker.model_name
        self._worker, self._stream, self._timing = worker, stream, timing
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._stream.next()
        except BaseException:  # cancelled, or the engine ended the request with an error
            self.abort()
            raise
        self._timing.on_output(output)
        if output.finished:
            self._done = True
        return output

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._worker.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self):  # -> Self
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.abort()

    def __del__(self) -> None:
        if not self._done:
            self._worker.abort(self.request_id)


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
        self._worker: _Worker | None = None
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

    def _require_worker(self) -> _Worker:
        worker = self._worker
        if worker is None:
            raise NoModelLoadedError(f"no model loaded (loading {self._loading})" if self._loading else
                                     NoModelLoadedError().message)
        return worker

    # ---- requests ---------------------------------------------------------------------------------------
    async def add_request(self, request_id: str | None = None, prompt: str | None = None,
                          params: SamplingParams | None = None, *, prompt_token_ids: list[int] | None = None,
                          model: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it; iterate the returned stream for outputs.

        ``model``: the model the caller tokenized for; if another one serves by now, ModelSwitchedError.
        Raises EngineError (bad input: 4xx) or NoModelLoadedError / ModelSwitchedError (503) here, before
        any output, so a server can still answer with a plain error status.
        """
        worker = self._require_worker()
        if model is not None and model != worker.model_name:
            raise ModelSwitchedError(f"model switched to {worker.model_name}")
        params = params or SamplingParams()
        validate_for_vocab(params, worker.vocab_size)
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop())
        timing = self.metrics.start_request(worker.model_name)
        worker.submit_add(request_id, prompt, prompt_token_ids, params, stream)
        try:
            await stream.added
        except asyncio.CancelledError:
            worker.abort(request_id)  # queued after the add: the loop thread drops it right away
            raise
        return RequestStream(worker, request_id, stream, timing)

    async def generate(self, prompt: str | None = None, params: SamplingParams | None = None,
                       request_id: str | None = None, *,
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative text/token ids per sample) until it finishes.

        Raises EngineError (bad input, before the first output), NoModelLoadedError, ModelSwitchedError or
        EngineStepError (mid-stream). Cancelling or closing the iterator aborts the request at once; use
        ``contextlib.aclosing`` so that also happens when the consumer stops early.
        """
        stream = await self.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids)
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

    def _start(self, args: EngineArgs) -> _Worker:
        engine = self._loader(args)
        try:
            worker = _Worker(engine, args)
        except EngineStepError:  # its warm-up failed: nothing serves this engine
            engine.release()
            raise
        self._worker = worker
        return worker

    def _retire(self, worker: _Worker, error: BaseException) -> None:
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

