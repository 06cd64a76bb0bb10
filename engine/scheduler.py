"""Continuous batching: waiting/running queues, token budget, chunked prefill, preemption -> SchedulerOutput.

Every step the scheduler decides which tokens to compute, using vLLM v1's counter model: a request has
``num_tokens`` (prompt + generated) and ``num_computed_tokens`` (whose KV is in the cache), and a step
computes some of the tokens in between. Prefill, chunked prefill, prefix-cache hits, recompute after
preemption and decode are all that one operation.

Order within a step: running requests first (decodes and ongoing chunked prefills, in admission order), then
waiting ones in FIFO order (preempted requests go back to the front), under ``max_num_seqs`` and the
``max_num_batched_tokens`` budget. When blocks run out for a running request, the newest running request is
preempted by recompute: its blocks are freed (full ones stay in the prefix cache, so recompute is often cheap)
and it restarts from zero later.

The step loop (engine, lead): ``out = schedule()``; runner copies ``out.copy_on_write`` blocks, runs
``out.scheduled`` and samples for items with ``needs_sample``; ``update_after_step(out, tokens)``; the engine
checks stop conditions of the returned requests and calls ``finish_request``. Requests in ``out.finished``
were ended by the scheduler itself (they outgrew the whole KV cache) and need their final output emitted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.admission import check_prompt_length, check_request_id
from engine.errors import EngineError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus

PLACEHOLDER_TOKEN = -1  # an output token scheduled ahead whose value the device has not returned yet


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. Without chunked prefill a whole prompt must fit one step's token budget."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise EngineError(f"{name} must be at least 1, got {getattr(self, name)}", param=name)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise EngineError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least max_model_len ({self.max_model_len}) so that every prompt fits one step",
                param="max_num_batched_tokens")


@dataclass(frozen=True)
class ScheduledRequest:
    """Compute ``all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]`` this step.

    ``num_computed_tokens`` and ``needs_sample`` are snapshots taken when scheduled (filled in from the
    request when not given), so they stay right after ``update_after_step`` has advanced the request.
    """

    request: Request
    num_new_tokens: int
    block_table: list[int]
    num_computed_tokens: int = -1
    needs_sample: bool | None = None

    def __post_init__(self) -> None:
        if self.num_computed_tokens < 0:
            object.__setattr__(self, "num_computed_tokens", self.request.num_computed_tokens)
        if self.needs_sample is None:
            end = self.num_computed_tokens + self.num_new_tokens
            object.__setattr__(self, "needs_sample", end == self.request.num_tokens)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The tokens to compute, sliced without building ``all_token_ids`` (long contexts, every step)."""
        prompt, output = self.request.prompt_token_ids, self.request.output_token_ids
        start, num_prompt = self.num_computed_tokens, len(prompt)
        end = start + self.num_new_tokens
        if start >= num_prompt:
            return output[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return prompt[start:end]
        return prompt[start:] + output[:end - num_prompt]

    @property
    def positions(self) -> range:
        return range(self.num_computed_tokens, self.num_computed_tokens + self.num_new_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work. ``copy_on_write`` (src, dst) block copies must happen before the forward."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    copy_on_write: list[tuple[int, int]]
    num_batched_tokens: int
    finished: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class RequestRow:
    """One line of the UI's request table."""

    request_id: str
    state: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    num_blocks: int
    num_preemptions: int


def _index_of(queue, request: Request) -> int | None:
    """Position by identity (Request is an eq-dataclass: ``list.remove`` would compare fields)."""
    return next((i for i, item in enumerate(queue) if item is request), None)


class Scheduler:
    """Decides each step's batch; owns the waiting/running queues and calls the KV cache manager."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._requests: dict[str, Request] = {}
        self._first_samples: dict[str, Request] = {}  # parent_id -> its sample 0 (the one children fork)

    # ---- admission ------------------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """Longest a request may grow (prompt + output): the context, capped by the whole KV cache.

        The engine must finish a request (length) once ``num_tokens`` reaches this; past it, it could not fit
        even with every other request preempted.
        """
        kv = self.kv_cache_manager
        return min(self.config.max_model_len, kv.num_total_blocks * kv.block_size)

    def add_request(self, request: Request, prompt_param: str = "prompt") -> None:
        """Queue a request, or raise EngineError if it can never run (``prompt_param``: the prompt field)."""
        self._validate(request, prompt_param)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)
        if request.parent_id is not None and request.sample_index == 0:
            self._first_samples[request.parent_id] = request

    def _validate(self, request: Request, prompt_param: str) -> None:
        num_prompt = request.num_prompt_tokens
        max_len = self.config.max_model_len
        check_request_id(request.request_id, self._requests)
        # A prompt that fills the context exactly can still be computed (engine callers leave room for output).
        check_prompt_length(num_prompt, max_len, prompt_param, min_output_tokens=0)
        kv = self.kv_cache_manager
        max_tokens = request.sampling_params.max_tokens or 0
        num_needed = kv.num_blocks_for_tokens(min(num_prompt + max_tokens, max_len))
        if num_needed > kv.num_total_blocks:
            capacity = kv.num_total_blocks * kv.block_size
            fits_prompt = kv.num_blocks_for_tokens(num_prompt) <= kv.num_total_blocks
            raise EngineError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs {num_needed} KV "
                f"blocks but the whole KV cache has {kv.num_total_blocks} ({capacity} tokens); "
                + ("lower max_tokens" if fits_prompt else "shorten the prompt")
                + " or give the KV cache more memory",
                param="max_tokens" if fits_prompt else prompt_param, code="context_length_exceeded")

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then waiting ones while budget and blocks last."""
        chosen: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        finished: list[Request] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, chosen, preempted, finished)
        if not preempted:  # blocks just ran out: admitting now would only thrash
            budget = self._schedule_waiting(budget, chosen, finished)
        copies = self.kv_cache_manager.take_copy_on_write()
        tables = self.kv_cache_manager.get_block_table
        scheduled = [ScheduledRequest(request, num_new, tables(request.request_id))
                     for request, num_new in chosen]
        return SchedulerOutput(scheduled=scheduled, preempted=preempted, copy_on_write=copies,
                               num_batched_tokens=self.config.max_num_batched_tokens - budget,
                               finished=finished)

    def _schedule_running(self, budget: int, chosen: list, preempted: list, finished: list) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            if not self._allocate_or_preempt(request, num_new, preempted, finished):
                break  # the request itself left running; it was the last one
            chosen.append((request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list, finished: list) -> bool:
        """Allocate for a running request, preempting the newest running requests until it fits."""
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                # Alone and still too big: it outgrew the whole cache (max_request_tokens not enforced).
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
                return False
            self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the blocks, restart from zero, first in line to come back."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, budget: int, chosen: list, finished: list) -> int:
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[index]
            parent = self._parent_of(request)
            if parent is not None and not self._prompt_done(parent):
                index += 1  # a sibling sample waits for its parent's prompt KV
                continue
            num_new = self._admit(request, parent, budget)
            if num_new == 0:
                if not self.running and not chosen:  # nothing holds blocks, yet it does not fit: never will
                    del self.waiting[index]
                    self._finish(request, RequestStatus.FINISHED_LENGTH, already_dequeued=True)
                    finished.append(request)
                    continue
                break  # FIFO: nobody overtakes a request that is waiting for blocks or budget
            del self.waiting[index]
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append((request, num_new))
            budget -= num_new
        return budget

    def _fit(self, num_remaining: int, budget: int) -> int:
        """Tokens of a new request that fit the budget: all, a chunk, or none (no chunked prefill)."""
        if num_remaining <= budget:
            return num_remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _admit(self, request: Request, parent: Request | None, budget: int) -> int:
        """Give a waiting request its blocks (prefix hits, fork, or fresh). Returns its tokens, 0 if none."""
        if parent is not None and parent.prompt_token_ids == request.prompt_token_ids:
            return self._admit_fork(request, parent, budget)
        kv = self.kv_cache_manager
        blocks, num_hits = kv.get_computed_blocks(request, record_stats=False)
        num_new = self._try_allocate(request, num_hits, blocks, budget)
        if num_new == 0 and blocks and not self.running:
            num_new = self._try_allocate(request, 0, [], budget)  # a full hit's copy-on-write may not fit
        if num_new and kv.enable_prefix_caching:
            kv.prefix_cache_stats.record(request.num_tokens, request.num_computed_tokens)
        if num_new and request.status == RequestStatus.WAITING:
            request.num_cached_tokens = request.num_computed_tokens
        return num_new

    def _try_allocate(self, request: Request, num_computed: int, blocks: list[int], budget: int) -> int:
        num_new = self._fit(request.num_tokens - num_computed, budget)
        if num_new == 0:
            return 0
        request.num_computed_tokens = num_computed
        if self.kv_cache_manager.allocate_slots(request, num_new, blocks):
            return num_new
        request.num_computed_tokens = 0
        return 0

    def _admit_fork(self, request: Request, parent: Request, budget: int) -> int:
        """Share the parent's prompt blocks; recompute only the last prompt token (for its own logits)."""
        kv = self.kv_cache_manager
        start = request.num_prompt_tokens - 1
        num_new = self._fit(request.num_tokens - start, budget)
        if num_new == 0:
            return 0
        kv.fork(parent, request, request.num_prompt_tokens)
        request.num_computed_tokens = start
        if not kv.allocate_slots(request, num_new):
            kv.free(request)
            request.num_computed_tokens = 0
            return 0
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = start
        return num_new

    def _parent_of(self, request: Request) -> Request | None:
        """The unfinished sample 0 of the request's group, if the request is a later sample."""
        if request.sample_index == 0 or request.parent_id is None:
            return None
        return self._first_samples.get(request.parent_id)

    def _prompt_done(self, parent: Request) -> bool:
        return (parent.status == RequestStatus.RUNNING
                and parent.num_computed_tokens >= parent.num_prompt_tokens
                and self.kv_cache_manager.num_blocks_held(parent.request_id) > 0)

    # ---- scheduling ahead (the next decode step before this one's tokens are known) ------------------
    def can_schedule_ahead(self, output: SchedulerOutput) -> bool:
        """Whether the step after ``output`` can be scheduled before ``output``'s tokens are known: it decodes
        every running request, schedule would admit nobody (nothing waits, or the running requests fill
        max_num_seqs), and the KV cache gives each request its next token's slot without preempting anyone
        (the same fresh-block count ``allocate_slots`` takes, plus one block per request for a copy-on-write)."""
        admits = self.waiting and len(self.running) < self.config.max_num_seqs
        if admits or output.preempted or output.finished or len(output.scheduled) != len(self.running):
            return False
        fresh = 0
        for item in output.scheduled:
            request = item.request
            if item.num_new_tokens != 1 or not item.needs_sample or request.status != RequestStatus.RUNNING:
                return False
            held = self.kv_cache_manager.num_blocks_held(request.request_id)
            fresh += max(0, -(-(request.num_tokens + 1) // self.kv_cache_manager.block_size) - held)
        return fresh + len(output.scheduled) <= self.kv_cache_manager.block_pool.num_available_blocks

    def advance_ahead(self, output: SchedulerOutput) -> None:
        """Count ``output``'s tokens computed and give each request a placeholder for the token it samples, so
        ``schedule`` plans the next decode step now; ``fill_ahead`` puts the sampled tokens in their place."""
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            item.request.output_token_ids.append(PLACEHOLDER_TOKEN)

    def fill_ahead(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Request]:
        """``update_after_step`` for a step that ``advance_ahead`` already counted: the sampled tokens replace
        the placeholders (a request ended meanwhile drops its placeholder), full blocks enter the prefix cache
        now that their tokens are known. Returns the requests that got a token."""
        with_new_token = []
        for item in output.scheduled:
            request = item.request
            index = item.num_computed_tokens + item.num_new_tokens - request.num_prompt_tokens
            if request.is_finished:
                del request.output_token_ids[index:]
                continue
            request.output_token_ids[index] = int(sampled_token_ids[request.request_id])
            with_new_token.append(request)
            if request.status == RequestStatus.RUNNING:  # (a preempted one recomputes its blocks later)
                self.kv_cache_manager.cache_full_blocks(request)
        return with_new_token

    # ---- after the forward ----------------------------------------------------------------------------
    def update_after_step(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Advance the counters; append the sampled token to requests that computed all their tokens.

        Returns those requests (the engine checks their stop conditions). Requests finished or preempted
        since ``schedule`` are skipped.
        """
        with_new_token = []
        for item in output.scheduled:
            request = item.request
            stale = request.num_computed_tokens != item.num_computed_tokens
            if request.status != RequestStatus.RUNNING or stale:
                continue
            request.num_computed_tokens += item.num_new_tokens
            if request.num_computed_tokens == request.num_tokens:
                if request.request_id not in sampled_token_ids:
                    raise KeyError(f"no sampled token for request {request.request_id!r}, which computed its "
                                   f"last token this step")
                request.output_token_ids.append(int(sampled_token_ids[request.request_id]))
                if request.first_token_time is None:
                    request.first_token_time = time.monotonic()
                with_new_token.append(request)
            self.kv_cache_manager.cache_full_blocks(request)
        return with_new_token

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request in any state: leave the queues, free its blocks, set its status (unknown: no-op)."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, status)

    def abort_request(self, request_id: str) -> None:
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus, already_dequeued: bool = False) -> None:
        if not already_dequeued:
            for queue in (self.running, self.waiting):
                index = _index_of(queue, request)
                if index is not None:
                    del queue[index]
        self.kv_cache_manager.free(request)
        request.status = status
        self._requests.pop(request.request_id, None)
        if request.parent_id is not None and self._first_samples.get(request.parent_id) is request:
            del self._first_samples[request.parent_id]

    # ---- introspection --------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def running_requests(self) -> list[Request]:
        return list(self.running)

    def request_rows(self) -> list[RequestRow]:
        """Running then waiting requests, as rows for the UI (tokens so far, blocks held, state)."""
        kv = self.kv_cache_manager
        return [RequestRow(r.request_id, r.status.value, r.num_prompt_tokens, r.num_output_tokens,
                           r.num_computed_tokens, r.num_cached_tokens, kv.num_blocks_held(r.request_id),
                           r.num_preemptions)
                for r in [*self.running, *self.waiting]]

    def stats(self) -> dict:
        kv = self.kv_cache_manager
        pool = kv.block_pool
        return {
            "num_total_blocks": pool.num_total_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_cached_blocks": pool.num_cached_blocks,
            "num_used_blocks": pool.num_used_blocks,
            "block_size": kv.block_size,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_stats.queries,
            "prefix_cache_hits": kv.prefix_cache_stats.hits,
            "prefix_cache_hit_rate": kv.prefix_cache_stats.hits / max(kv.prefix_cache_stats.queries, 1),
            "num_evictions": pool.num_evictions,
            "kv_cache_usage": kv.usage,
        }
