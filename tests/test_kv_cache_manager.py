"""KV cache manager: block tables, prefix hits, copy-on-write and fork, hand-counted with block_size 4."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=8))


def compute(kv: KVCacheManager, request: Request, num_new: int, computed_blocks=None) -> None:
    """What one scheduled step does to the manager: allocate, 'run', advance, cache full blocks."""
    assert kv.allocate_slots(request, num_new, computed_blocks)
    kv.take_copy_on_write()
    request.num_computed_tokens += num_new
    kv.cache_full_blocks(request)


def pool_state(kv: KVCacheManager) -> tuple[int, int, int]:
    pool = kv.block_pool
    return pool.num_free_blocks, pool.num_cached_blocks, pool.num_used_blocks


def test_table_grows_by_ceil_div_never_more():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    request = make_request("a", range(10))
    compute(kv, request, 10)
    assert len(kv.get_block_table("a")) == 3  # ceil(10 / 4), nothing reserved for max_tokens
    expected = {11: 3, 12: 3, 13: 4, 14: 4, 15: 4, 16: 4, 17: 5}  # computed tokens -> blocks, by hand
    for num_computed, num_blocks in expected.items():
        request.output_token_ids.append(0)  # a decode step: compute the token sampled last step
        compute(kv, request, 1)
        assert request.num_computed_tokens == num_computed
        assert len(kv.get_block_table("a")) == num_blocks
    assert kv.usage == 5 / 10


def test_chunks_allocate_only_what_they_cover():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    request = make_request("a", range(13))
    compute(kv, request, 5)
    assert len(kv.get_block_table("a")) == 2
    compute(kv, request, 5)
    assert len(kv.get_block_table("a")) == 3
    compute(kv, request, 3)
    assert len(kv.get_block_table("a")) == 4


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a, b = make_request("a", range(8)), make_request("b", range(100, 108))
    compute(kv, a, 8)
    before = (pool_state(kv), kv.get_block_table("a"))
    assert not kv.allocate_slots(b, 8)
    assert (pool_state(kv), kv.get_block_table("a")) == before
    assert kv.get_block_table("b") == []
    assert kv.allocate_slots(b, 4)


def test_prefix_hit_shares_full_blocks_of_the_same_chain():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", range(10))
    compute(kv, a, 10)
    a_table = kv.get_block_table("a")
    kv.free(a)
    assert pool_state(kv) == (8, 2, 0)  # 2 full blocks cached, the partial one is plain free

    b = make_request("b", list(range(8)) + [50, 51, 52])
    blocks, hits = kv.get_computed_blocks(b)
    assert blocks == a_table[:2] and hits == 8
    b.num_computed_tokens = hits
    compute(kv, b, 3, blocks)
    assert kv.get_block_table("b")[:2] == a_table[:2]
    assert kv.block_pool.ref_count(a_table[0]) == 1 and pool_state(kv) == (7, 0, 3)

    c = make_request("c", [99] + list(range(1, 10)))  # differs in token 0: no block can match
    assert kv.get_computed_blocks(c) == ([], 0)
    d = make_request("d", [0, 1, 2, 3, 4, 5, 6, 99])  # block 0 matches, block 1 does not
    assert kv.get_computed_blocks(d) == (a_table[:1], 4)
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (11 + 10 + 8, 8 + 0 + 4)


def test_full_hit_leaves_the_last_token_and_copies_the_block_it_writes():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", range(8))
    compute(kv, a, 8)
    a_table = kv.get_block_table("a")
    b = make_request("b", range(8))
    blocks, hits = kv.get_computed_blocks(b)
    assert blocks == a_table and hits == 7  # all 8 hit; position 7 must still run for its logits
    b.num_computed_tokens = hits
    assert kv.allocate_slots(b, 1, blocks)
    b_table = kv.get_block_table("b")
    assert b_table[0] == a_table[0] and b_table[1] not in a_table
    assert kv.take_copy_on_write() == [(a_table[1], b_table[1])]
    assert kv.take_copy_on_write() == []
    assert [kv.block_pool.ref_count(x) for x in a_table] == [2, 1]
    assert len(b_table) == 2  # the copy replaced the block; nothing extra allocated


def test_full_hit_on_cached_free_blocks_counts_them_as_unavailable():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    a = make_request("a", range(8))
    compute(kv, a, 8)
    kv.free(a)
    assert pool_state(kv) == (0, 2, 0)
    b = make_request("b", range(8))
    blocks, hits = kv.get_computed_blocks(b)
    b.num_computed_tokens = hits
    # Reviving both cached blocks leaves nothing for the copy of the last one: must refuse, untouched.
    assert not kv.allocate_slots(b, 1, blocks)
    assert pool_state(kv) == (0, 2, 0) and kv.get_block_table("b") == []


def test_free_releases_tail_first_so_the_tail_is_evicted_first():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", range(12))
    compute(kv, a, 12)
    table = kv.get_block_table("a")
    kv.free(a)
    assert pool_state(kv) == (0, 3, 0)
    b = make_request("b", range(100, 104))
    compute(kv, b, 4)
    assert kv.get_block_table("b") == [table[2]]  # the tail block went first
    probe = make_request("p", range(12))
    assert kv.get_computed_blocks(probe, record_stats=False) == (table[:2], 8)


def test_fork_shares_blocks_and_copy_on_write_isolates_the_child():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_request("p", range(6))
    compute(kv, parent, 6)
    p_table = kv.get_block_table("p")
    child = make_request("c", range(6))
    kv.fork(parent, child)
    assert kv.get_block_table("c") == p_table
    assert [kv.block_pool.ref_count(x) for x in p_table] == [2, 2]
    child.num_computed_tokens = 5  # recompute the last prompt token (position 5, in block 1)
    assert kv.allocate_slots(child, 1)
    c_table = kv.get_block_table("c")
    assert c_table[0] == p_table[0] and c_table[1] not in p_table
    assert kv.take_copy_on_write() == [(p_table[1], c_table[1])]
    assert kv.get_block_table("p") == p_table  # the parent never sees the child's writes
    assert [kv.block_pool.ref_count(x) for x in p_table] == [2, 1]
    kv.free(parent)
    kv.free(child)
    assert pool_state(kv) == (7, 1, 0)  # block 0 (full, hashed) stays cached; nothing is referenced


def test_fork_of_a_prefix_takes_only_the_blocks_covering_it():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    parent = make_request("p", range(5))
    compute(kv, parent, 5)
    parent.output_token_ids += [7, 7, 7, 7]
    compute(kv, parent, 4)
    assert len(kv.get_block_table("p")) == 3
    child = make_request("c", range(5))
    kv.fork(parent, child, num_tokens=5)
    assert kv.get_block_table("c") == kv.get_block_table("p")[:2]
    child.num_computed_tokens = 4
    assert kv.allocate_slots(child, 1)  # position 4 is in shared block 1 (ref 2, unhashed) -> copy
    assert len(kv.take_copy_on_write()) == 1


def test_chained_copy_on_write_copies_from_the_original_source():
    """A copy whose source is the not-yet-filled destination of another copy reads the original block."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    parent = make_request("p", range(6))
    compute(kv, parent, 6)
    original = kv.get_block_table("p")[1]
    first, second = make_request("c1", range(6)), make_request("c2", range(6))
    kv.fork(parent, first)
    first.num_computed_tokens = 5
    assert kv.allocate_slots(first, 1)
    kv.fork(first, second)
    second.num_computed_tokens = 5
    assert kv.allocate_slots(second, 1)
    copies = kv.take_copy_on_write()
    assert [src for src, _ in copies] == [original, original]
    assert len({dst for _, dst in copies} | {original}) == 3


def test_everything_returns_after_free():
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    requests = [make_request(str(i), list(range(3 * i + 1))) for i in range(4)]
    for request in requests:
        blocks, hits = kv.get_computed_blocks(request)
        request.num_computed_tokens = hits
        compute(kv, request, request.num_tokens - hits, blocks)
        # waste: allocated slots exceed stored tokens by less than one block
        assert 0 <= len(kv.get_block_table(request.request_id)) * BS - request.num_computed_tokens < BS
    for request in requests:
        kv.free(request)
    free, cached, used = pool_state(kv)
    assert used == 0 and free + cached == 12 and kv.usage == 0.0
