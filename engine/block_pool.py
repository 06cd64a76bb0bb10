"""KV blocks with reference counts, a free list, the prefix-cache map and the LRU of cached-free blocks.

A block is one fixed-size slab of KV slots (``block_size`` tokens, all layers). The pool only hands out block
ids and keeps their bookkeeping; the KV tensors themselves live in the model runner.

Every block is in exactly one of three states:

- free:   ref count 0, no hash. Handed out first.
- cached: ref count 0, still holding the hash of the full block it stores. It can be revived by a later
          request with the same prefix (``touch``) or evicted (hash dropped) when a fresh block is needed and
          no free block is left. Cached blocks are evicted least recently freed first.
- used:   ref count > 0 (shared by several requests when > 1).

Block hashes form a chain over FULL blocks: ``hash(parent_hash, tokens of the block)``, so a block's hash
covers every token before it, and two requests share a block only when their whole prefix up to the end of
that block is identical.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

BlockHash = bytes

_ROOT_HASH = b"\x00" * 16  # parent of block 0


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """16-byte blake2b digest of (parent hash, token ids): collisions are negligible (2**-64 bound)."""
    digest = hashlib.blake2b(parent_hash or _ROOT_HASH, digest_size=16)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent_hashes: Sequence[BlockHash] = (),
                     ) -> list[BlockHash]:
    """Hash chain of every full block of ``token_ids``; ``parent_hashes`` are already-known leading hashes.

    Passing the hashes computed at an earlier step lets callers extend a request's chain incrementally.
    """
    hashes = list(parent_hashes)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start:start + block_size]))
    return hashes


class BlockPool:
    """Allocates, shares, caches and evicts block ids. Pure bookkeeping: no tensors here."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, no hash; popleft to allocate
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0 with hash; first = evicted first
        self._hash_to_block: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # ---- counters -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 and no hash."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with ref count 0 that still hold a prefix hash (evictable)."""
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_total_blocks - len(self._free) - len(self._cached_free)

    @property
    def num_available_blocks(self) -> int:
        """Blocks ``get_new_blocks`` can hand out right now (free + evictable)."""
        return len(self._free) + len(self._cached_free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hashes[block_id]

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._cached_free

    # ---- allocation -----------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` fresh blocks (ref 1, no hash): free ones first, then evict cached (LRU)."""
        if num_blocks > self.num_available_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, only {self.num_available_blocks} available")
        blocks = []
        for _ in range(num_blocks):
            block_id = self._free.popleft() if self._free else self._evict_one()
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def _evict_one(self) -> int:
        block_id, _ = self._cached_free.popitem(last=False)
        self._drop_hash(block_id)
        self.num_evictions += 1
        return block_id

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None and self._hash_to_block.get(block_hash) == block_id:
            del self._hash_to_block[block_hash]
        self._hashes[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a cached-free block leaves the LRU (it is in use again)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._cached_free:
                    raise RuntimeError(f"touch of block {block_id}, which is free and holds no cached data")
                del self._cached_free[block_id]
            self._ref_counts[block_id] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order.

        A block reaching ref 0 goes to the end of the LRU if it holds a hash (so it is evicted after every
        block freed before it), else back to the free list. Callers pass a request's blocks tail first, so
        that the tail of a prefix, the least likely part to be shared, is evicted first.
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._hashes[block_id] is not None:
                    self._cached_free[block_id] = None
                else:
                    self._free.append(block_id)

    # ---- prefix cache ---------------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding the full block with this chain hash, if cached (in use or cached-free)."""
        if not self.enable_prefix_caching:
            return None
        return self._hash_to_block.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a used, full, computed block under its chain hash. Returns whether it was registered.

        A hash already held by another block is not re-registered (two requests computed the same prefix at
        the same time): the duplicate simply stays an ordinary block and is freed as such.
        """
        if not self.enable_prefix_caching or self._hashes[block_id] is not None:
            return False
        if self._ref_counts[block_id] <= 0:
            raise RuntimeError(f"cannot cache block {block_id}: it is not in use")
        if block_hash in self._hash_to_block:
            return False
        self._hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Evict every cached-free block (e.g. after loading other weights). Returns how many were dropped."""
        num_dropped = len(self._cached_free)
        while self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            self._drop_hash(block_id)
            self._free.append(block_id)
        return num_dropped
