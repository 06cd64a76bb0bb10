"""Block pool: ref counts, the three block states, the prefix hash chain and LRU eviction (hand-counted)."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, hash_block_tokens, hash_full_blocks


def assert_counters(pool: BlockPool, free: int, cached: int, used: int) -> None:
    assert (pool.num_free_blocks, pool.num_cached_blocks, pool.num_used_blocks) == (free, cached, used)
    assert pool.num_free_blocks + pool.num_cached_blocks + pool.num_used_blocks == pool.num_total_blocks


def fill_cached(pool: BlockPool, count: int) -> tuple[list[int], list[bytes]]:
    """Allocate ``count`` blocks and register a distinct hash for each."""
    blocks = pool.get_new_blocks(count)
    hashes = [hash_block_tokens(None, [1000 + i]) for i in range(count)]
    for block_id, block_hash in zip(blocks, hashes):
        assert pool.cache_block(block_id, block_hash)
    return blocks, hashes


def test_allocate_and_free_update_counters_and_refs():
    pool = BlockPool(8)
    assert_counters(pool, free=8, cached=0, used=0)
    blocks = pool.get_new_blocks(3)
    assert len(set(blocks)) == 3 and all(pool.ref_count(b) == 1 for b in blocks)
    assert_counters(pool, free=5, cached=0, used=3)
    pool.touch(blocks[:1])  # a second request shares the first block
    assert pool.ref_count(blocks[0]) == 2
    pool.free_blocks(blocks)
    assert_counters(pool, free=7, cached=0, used=1)
    pool.free_blocks(blocks[:1])
    assert_counters(pool, free=8, cached=0, used=0)


def test_over_allocation_raises_and_double_free_is_caught():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError):
        pool.free_blocks(blocks[:1])


def test_hash_chain_same_prefix_same_hashes():
    tokens = list(range(40))
    a = hash_full_blocks(tokens, 8)
    b = hash_full_blocks(tokens[:35] + [999] * 5, 8)  # differs only in the last (partial-at-35) block
    assert len(a) == 5 and len(b) == 5
    assert a[:4] == b[:4] and a[4] != b[4]
    assert len(hash_full_blocks(tokens[:39], 8)) == 4  # a partial block is never hashed
    assert all(len(h) == 16 for h in a)


def test_hash_chain_difference_in_block_zero_changes_every_later_hash():
    tokens = list(range(32))
    changed = [7] + tokens[1:]
    a, b = hash_full_blocks(tokens, 8), hash_full_blocks(changed, 8)
    # blocks 1..3 hold identical tokens, but their chain hash covers block 0 too
    assert all(x != y for x, y in zip(a, b))
    assert hash_block_tokens(None, tokens[8:16]) == hash_block_tokens(None, changed[8:16])


def test_hash_chain_is_incremental_and_order_sensitive():
    tokens = list(range(24))
    full = hash_full_blocks(tokens, 8)
    assert hash_full_blocks(tokens, 8, full[:1]) == full
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(full[0], [1, 2]) != hash_block_tokens(None, [1, 2])


def test_freed_hashed_blocks_become_cached_and_are_found():
    pool = BlockPool(4)
    blocks, hashes = fill_cached(pool, 2)
    assert pool.get_cached_block(hashes[0]) == blocks[0]
    pool.free_blocks(reversed(blocks))
    assert_counters(pool, free=2, cached=2, used=0)
    assert [pool.get_cached_block(h) for h in hashes] == blocks


def test_uncached_free_blocks_are_used_before_any_eviction():
    pool = BlockPool(6)
    blocks, hashes = fill_cached(pool, 4)
    pool.free_blocks(blocks)
    assert_counters(pool, free=2, cached=4, used=0)
    fresh = pool.get_new_blocks(2)
    assert not set(fresh) & set(blocks)
    assert all(pool.get_cached_block(h) is not None for h in hashes)
    assert pool.num_evictions == 0


def test_eviction_follows_free_order_least_recently_freed_first():
    pool = BlockPool(4)
    blocks, hashes = fill_cached(pool, 4)
    free_order = [blocks[2], blocks[0], blocks[3], blocks[1]]
    pool.free_blocks(free_order)
    assert_counters(pool, free=0, cached=4, used=0)
    for step, expected in enumerate(free_order):
        (new,) = pool.get_new_blocks(1)
        assert new == expected
        assert pool.block_hash(new) is None  # its hash was dropped on eviction
        still_cached = {pool.get_cached_block(h) for h in hashes} - {None}
        assert still_cached == set(free_order[step + 1:])
    assert pool.num_evictions == 4


def test_touch_of_cached_block_revives_it_and_removes_it_from_lru():
    pool = BlockPool(3)
    blocks, hashes = fill_cached(pool, 3)
    pool.free_blocks(blocks)  # LRU: blocks[0], blocks[1], blocks[2]
    pool.touch([blocks[0]])  # a new request with the same prefix reuses it
    assert pool.ref_count(blocks[0]) == 1 and not pool.is_cached_free(blocks[0])
    assert_counters(pool, free=0, cached=2, used=1)
    assert pool.get_new_blocks(1) == [blocks[1]]  # the next in LRU order, not the revived one
    assert pool.get_cached_block(hashes[0]) == blocks[0]
    pool.free_blocks([blocks[0]])  # back at the END of the LRU: evicted after blocks[2]
    assert pool.get_new_blocks(2) == [blocks[2], blocks[0]]


def test_touch_of_a_plain_free_block_is_an_error():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.touch([0])


def test_duplicate_hash_is_not_registered_twice():
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [1, 2, 3])
    assert pool.cache_block(first, block_hash)
    assert not pool.cache_block(second, block_hash)
    pool.free_blocks([first, second])
    assert_counters(pool, free=3, cached=1, used=0)  # the duplicate went back as a plain free block
    assert pool.get_cached_block(block_hash) == first


def test_prefix_caching_disabled_never_caches():
    pool = BlockPool(4, enable_prefix_caching=False)
    (block,) = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [5])
    assert not pool.cache_block(block, block_hash)
    assert pool.get_cached_block(block_hash) is None
    pool.free_blocks([block])
    assert_counters(pool, free=4, cached=0, used=0)


def test_reset_prefix_cache_frees_every_cached_block():
    pool = BlockPool(4)
    blocks, hashes = fill_cached(pool, 3)
    pool.free_blocks(blocks[:2])
    assert pool.reset_prefix_cache() == 2
    assert_counters(pool, free=3, cached=0, used=1)
    assert pool.get_cached_block(hashes[0]) is None and pool.get_cached_block(hashes[2]) == blocks[2]
