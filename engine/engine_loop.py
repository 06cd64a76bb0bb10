"""The loop thread of one loaded model: the only code that touches its LLMEngine after construction.

Why a thread: ``LLMEngine.step()`` is blocking torch work. Running it on the event loop would freeze every HTTP
connection (and the UI) for the length of a step. Everything else talks to the thread through an ordered queue of
typed commands (``AddRequest``, ``AbortRequest``, ``RefreshSnapshot``, ``Stop``) guarded by a condition variable;
the thread sleeps on the condition when there is nothing to do, so an idle server burns no CPU. After each step it
publishes a frozen ``EngineSnapshot`` (engine/snapshot.py): the only thing other threads read. Outputs go back to
each request's ``OutputChannel`` (engine/streams.py), one ``call_soon_threadsafe`` per step and event loop.

The thread warms its engine up (engine/warmup.py) before looping; the constructor waits for that, so a model
serves only once its first steps are warm, and a failed warm-up raises there.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from engine.admission import Admission
from engine.config import EngineArgs
from engine.errors import EngineStepError
from engine.request import RequestOutput, SamplingParams
from engine.snapshot import EngineSnapshot, MemorySnapshot
from engine.streams import OutputChannel, post_outputs

log = logging.getLogger("pagoda.async_engine")


@dataclass(frozen=True)
class AddRequest:
    """Admit a request; the engine's answer (accepted, or the EngineError) goes to ``stream.added``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: OutputChannel
    prompt_param: str = "prompt"  # the field the prompt came from, named in a refusal


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


class EngineLoop:
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
        self.admission = Admission(self.max_model_len, self.vocab_size)  # immutable: any thread may use it
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()
        self._streams: dict[str, OutputChannel] = {}  # loop thread only
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
                   params: SamplingParams, stream: OutputChannel, prompt_param: str = "prompt") -> None:
        self._push(AddRequest(request_id, prompt, prompt_token_ids, params, stream, prompt_param))

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
                                    prompt_token_ids=command.prompt_token_ids, params=command.params,
                                    prompt_param=command.prompt_param)
        except Exception as exc:  # noqa: BLE001 -- EngineError for bad input; anything else goes to the caller too
            stream.post(stream.set_added, exc)
            return
        self._streams[command.request_id] = stream
        if not stream.post(stream.set_added, None):
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
                stream.post(stream.fail, copy.copy(error))
                self._abort(request_id)
            return []

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Post the step's outputs, one hand-over per consumer event loop; a closed loop's requests are aborted."""
        by_loop: dict[object, list[tuple[OutputChannel, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, output))
        for handover in by_loop.values():
            if not post_outputs(handover):
                for _, output in handover:
                    if not output.finished:
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
                command.stream.post(command.stream.fail, copy.copy(error))
        for request_id, stream in list(self._streams.items()):
            stream.post(stream.fail, copy.copy(error))
            try:
                self._abort(request_id)
            except Exception:  # noqa: BLE001 -- the engine may be what failed; the streams are told already
                self._streams.pop(request_id, None)
