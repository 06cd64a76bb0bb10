"""EngineSnapshot: what threads other than the engine loop may know about a served engine.

Why: the loop thread is the only code that touches an LLMEngine (its scheduler queues, block pool and runner change
inside every step). The UI, /metrics and /health run on other threads; reading those structures there raced with
the step. So after each step the loop builds one frozen ``EngineSnapshot`` and publishes it by swapping a single
reference; a reader takes that reference and sees one consistent moment: counts, request rows and counters all
from the same step.

The memory report reads /proc and the driver, so the loop refreshes it at most a few times a second while it
steps, and on request (``RefreshSnapshot``) while idle; it carries its own ``taken_at``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from engine.scheduler import RequestRow

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.memory import MemoryReport


@dataclass(frozen=True)
class KVCounts:
    """The block pool and prefix cache at the end of a step."""

    block_size: int
    num_total_blocks: int
    num_free_blocks: int  # never used, or evicted
    num_cached_blocks: int  # free but holding a reusable prefix
    num_used_blocks: int
    num_evictions: int
    usage: float  # num_used_blocks / num_total_blocks
    prefix_cache_queries: int
    prefix_cache_hits: int


@dataclass(frozen=True)
class TokenCounters:
    """Monotonic totals since the engine was built (Prometheus counters)."""

    prompt_tokens: int
    generation_tokens: int
    finished: MappingProxyType  # finish_reason -> samples finished with it (read-only)


@dataclass(frozen=True)
class MemorySnapshot:
    """A memory report (engine/memory.py) and when the loop read it (``time.monotonic()``)."""

    report: MemoryReport
    taken_at: float


@dataclass(frozen=True)
class EngineSnapshot:
    """One engine at the end of one loop iteration. Never mutated; the loop publishes a new one each step."""

    model_name: str
    max_model_len: int
    step: int  # loop iterations that ran an engine step so far
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv: KVCounts
    counters: TokenCounters
    requests: tuple[RequestRow, ...]  # running first (admission order), then waiting
    memory: MemorySnapshot | None = None
    memory_budget: int | None = None  # the device budget the KV pool was sized against
    taken_at: float = field(default_factory=time.monotonic)

    def stats(self) -> dict:
        """The flat counter dict (the keys ``LLMEngine.stats()`` always had)."""
        kv = self.kv
        return {
            "num_total_blocks": kv.num_total_blocks, "num_free_blocks": kv.num_free_blocks,
            "num_cached_blocks": kv.num_cached_blocks, "num_used_blocks": kv.num_used_blocks,
            "block_size": kv.block_size, "num_running": self.num_running, "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions, "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_hit_rate": kv.prefix_cache_hits / max(kv.prefix_cache_queries, 1),
            "num_evictions": kv.num_evictions, "kv_cache_usage": kv.usage,
            "prompt_tokens_total": self.counters.prompt_tokens,
            "generation_tokens_total": self.counters.generation_tokens,
            "request_success_total": dict(self.counters.finished), "max_model_len": self.max_model_len,
        }


def take_snapshot(engine: LLMEngine, *, step: int = 0, memory: MemorySnapshot | None = None) -> EngineSnapshot:
    """Read ``engine`` into a snapshot. Only the thread that steps the engine may call this."""
    scheduler, kv = engine.scheduler, engine.kv_manager
    pool, prefix = kv.block_pool, kv.prefix_cache_stats
    counts = KVCounts(kv.block_size, pool.num_total_blocks, pool.num_free_blocks, pool.num_cached_blocks,
                      pool.num_used_blocks, pool.num_evictions, kv.usage, prefix.queries, prefix.hits)
    counters = TokenCounters(engine.counters.prompt_tokens, engine.counters.generation_tokens,
                             MappingProxyType(dict(engine.counters.finished)))
    profile = getattr(engine.runner, "memory_profile", None)
    return EngineSnapshot(engine.model_name, engine.max_model_len, step, scheduler.num_running,
                          scheduler.num_waiting, scheduler.num_preemptions, counts, counters,
                          tuple(scheduler.request_rows()), memory, profile.budget if profile else None)
