"""One request's outputs on its way from the engine loop thread to an asyncio consumer, and SSE deltas.

Why here: the loop thread must never block on a consumer and a slow consumer must never grow a queue. So the loop
posts a step's outputs to the consumer's event loop (``post_outputs``: one ``call_soon_threadsafe`` a step), where
``OutputChannel`` keeps only the newest one: ``RequestOutput`` text and token ids are cumulative, so a slow reader just sees bigger deltas.
``DeltaTracker`` turns those cumulative outputs into per-sample deltas for SSE.

``RequestStream`` is what ``AsyncEngine.add_request`` hands out. Leaving it early (``aclose``, ``async with``,
cancellation, garbage collection) queues an abort, and the loop thread frees the request's KV blocks before its next
step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.request import Logprob, RequestOutput


class Aborter(Protocol):
    """What a stream needs of the engine loop that serves it."""

    model_name: str

    def abort(self, request_id: str) -> None: ...


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


# ---- one request's hand-over ---------------------------------------------------------------------------------
class OutputChannel:
    """The consumer side of one request: the newest output or an error, handed over from the loop thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.added: asyncio.Future = loop.create_future()
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    # Called on the event loop (scheduled from the engine thread).
    def set_added(self, error: BaseException | None) -> None:
        if self.added.done():
            return
        if error is None:
            self.added.set_result(None)
        else:
            self.added.set_exception(error)

    def put(self, output: RequestOutput) -> None:
        self.latest = output
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.set_added(error)
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


def post_outputs(handover: list[tuple[OutputChannel, RequestOutput]]) -> bool:
    """Hand one step's outputs to their channels, all on one event loop, with one wake-up (called from the engine
    thread).

    Why one call: each ``call_soon_threadsafe`` writes to the loop's self-pipe (a system call) and wakes it, so a
    step of 128 requests posted one by one cost 128 of each. False if the loop is closed (nobody listens)."""
    return handover[0][0].post(_put_each, handover)


def _put_each(handover: list[tuple[OutputChannel, RequestOutput]]) -> None:
    for channel, output in handover:
        channel.put(output)


class RequestStream:
    """The outputs of one accepted request. Leaving it early (``aclose``, ``async with``, cancellation, garbage
    collection) aborts the request, which frees its KV blocks before the engine's next step."""

    def __init__(self, worker: Aborter, request_id: str, stream: OutputChannel, timing):
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
