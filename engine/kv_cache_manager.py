"""Per-request block tables over a BlockPool: prefix lookup, allocate, cache, free, fork and copy-on-write.

A request's block table maps its token positions to KV slots: position ``p`` lives in block
``table[p // block_size]`` at offset ``p % block_size``. Tables only ever grow to cover the tokens that are
computed or about to be computed (no reservation for ``max_tokens``), so at most the last block of a request
is partly empty.

Copy-on-write: a request may write KV only into a block that it holds alone and that is not registered in the
prefix cache (cached blocks are immutable, so every later reader sees exactly the KV of the request that
filled it). Writes into such blocks only happen when a request recomputes the last token of a full-prefix
hit or of a forked prompt; the block is then replaced in that request's table by a fresh one, and the pair
(src, dst) is queued for the runner, which must copy the KV of ``src`` into ``dst`` before the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockHash, BlockPool, hash_full_blocks
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Token counts: ``queries`` tokens looked up, ``hits`` of them found computed in the cache."""

    queries: int = 0
    hits: int = 0

    def record(self, num_queried: int, num_hits: int) -> None:
        self.queries += num_queried
        self.hits += num_hits


class KVCacheManager:
    """Owns every request's block table; the scheduler calls it, the runner reads the tables and copies."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # chain over the request's full blocks, grown lazily
        self._num_registered: dict[str, int] = {}  # leading table entries already offered to the cache
        self._pending_copies: list[tuple[int, int]] = []
        self._pending_release: list[int] = []  # CoW sources kept alive until the copies are taken

    # ---- queries --------------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_total_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-free blocks count as free)."""
        return self.block_pool.num_used_blocks / self.block_pool.num_total_blocks

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block ids in position order (a copy; empty if it holds none)."""
        return list(self._tables.get(request_id, ()))

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        known = self._hashes.get(request.request_id, [])
        if (len(known) + 1) * self.block_size <= request.num_tokens:
            known = hash_full_blocks(request.all_token_ids, self.block_size, known)
            self._hashes[request.request_id] = known
        return known

    # ---- prefix cache ---------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching the request's tokens, and the tokens they cover.

        When every token hits, the count is ``num_tokens - 1``: the model still has to run the last position
        to produce its logits (that write into a cached block goes through copy-on-write). The query counts
        ``num_tokens`` tokens in the stats; pass ``record_stats=False`` for a tentative lookup and record the
        admitted one with ``prefix_cache_stats.record``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        blocks: list[int] = []
        for block_hash in self._block_hashes(request):
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        num_hits = min(len(blocks) * self.block_size, request.num_tokens - 1)
        if record_stats:
            self.prefix_cache_stats.record(request.num_tokens, num_hits)
        return blocks, num_hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the hashes of the request's blocks that are now full AND computed."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for index in range(start, num_full):
            self.block_pool.cache_block(table[index], hashes[index])
        self._num_registered[request.request_id] = num_full

    # ---- allocation -----------------------------------------------------------------------------------
    def _needs_copy(self, block_id: int) -> bool:
        pool = self.block_pool
        return pool.ref_count(block_id) > 1 or pool.block_hash(block_id) is not None

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Grow the request's table to cover ``num_computed_tokens + num_new_tokens`` tokens.

        ``computed_blocks`` (from ``get_computed_blocks``, only for a request holding no blocks yet) are
        shared first; the caller has already set ``num_computed_tokens`` to the hit count. Blocks the new
        tokens will be written into but that are shared or cached are replaced by copies (see
        ``take_copy_on_write``).
        Returns False, changing nothing, when the pool cannot provide the blocks.
        """
        pool = self.block_pool
        computed = computed_blocks or []
        table = self._tables.get(request.request_id)
        if table is None:
            table = []
        elif computed:
            raise RuntimeError(f"request {request.request_id} already holds blocks; hits are for new ones")
        num_held = len(table) + len(computed)  # computed blocks come after the (then empty) table
        num_required = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_fresh = max(0, num_required - num_held)
        # Blocks that already exist and receive writes: shared or cached ones need a copy. Prefix hits are
        # cached blocks, so a write into one of them is always a copy. (Usually zero or one index.)
        written = range(request.num_computed_tokens // self.block_size, min(num_held, num_required))
        copies = [i for i in written if i >= len(table) or self._needs_copy(table[i])]
        num_revived = sum(1 for block_id in computed if pool.ref_count(block_id) == 0)
        if num_fresh + len(copies) > pool.num_available_blocks - num_revived:
            return False
        if computed:
            pool.touch(computed)
            table.extend(computed)
        for index in copies:
            table[index] = self._copy_on_write(table[index])
        if num_fresh:
            table.extend(pool.get_new_blocks(num_fresh))
        self._tables[request.request_id] = table
        return True

    def _copy_on_write(self, src: int) -> int:
        """A fresh block for a write into ``src``; ``src`` keeps its reference until the copy is taken."""
        (dst,) = self.block_pool.get_new_blocks(1)
        # If src is itself the (not yet filled) destination of an earlier copy, copy from that copy's source.
        origin = next((s for s, d in self._pending_copies if d == src), src)
        self._pending_copies.append((origin, dst))
        self._pending_release.append(src)
        return dst

    def take_copy_on_write(self) -> list[tuple[int, int]]:
        """The (src_block, dst_block) KV copies the runner must do before the next forward; clears them.

        Sources stay referenced until this call so that no copy source can be reused within the same
        scheduling step: the copies are independent of their order (a batched gather/scatter is fine).
        """
        copies, self._pending_copies = self._pending_copies, []
        release, self._pending_release = self._pending_release, []
        self.block_pool.free_blocks(release)
        return copies

    # ---- release and sharing --------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Drop the request's table, tail blocks first: their cached copies are evicted before the head's."""
        table = self._tables.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(table))
        self._hashes.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> None:
        """Share the parent's blocks covering its first ``num_tokens`` tokens (all by default) with the child.

        Used for ``n > 1`` samples: the child reads the parent's prompt KV; its first write into a shared
        block goes through copy-on-write.
        """
        if self._tables.get(child.request_id):
            raise RuntimeError(f"fork into request {child.request_id}, which already holds blocks")
        table = self._tables.get(parent.request_id, [])
        if num_tokens is not None:
            table = table[:cdiv(num_tokens, self.block_size)]
        self.block_pool.touch(table)
        self._tables[child.request_id] = list(table)
