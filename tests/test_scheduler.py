"""Scheduler: budgets, chunked prefill, admission order, preemption, prefix hits, n>1 forks, aborts.

A fake model stands in for the runner: its "KV cache" stores the token id of each position in paged slots,
it writes through the block tables the scheduler hands out, reads every request's context back through them,
and samples a token that is a hash of that context. Outputs are compared with an independent reference that
generates each request alone from its token list, so any mix-up of blocks (bad prefix hit, missing
copy-on-write, wrong recompute after preemption) shows up as a wrong token.
"""

from __future__ import annotations

import random

import pytest

from engine.errors import EngineError
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 4
VOCAB = 50
EOS = 0


def next_token(context: list[int], salt: int = 0) -> int:
    """The fake model: a deterministic function of the whole context (and the sample's index)."""
    acc = salt * 7919
    for position, token in enumerate(context):
        acc = (acc * 1_000_003 + token * (position + 1)) % 2**61
    return acc % VOCAB


def reference_output(request: Request, max_len: int) -> list[int]:
    """What the request generates alone: no batching, no paging, no cache."""
    tokens, output = list(request.prompt_token_ids), []
    while True:
        token = next_token(tokens, request.sample_index)
        tokens.append(token)
        output.append(token)
        if (len(output) >= request.sampling_params.max_tokens or len(tokens) >= max_len
                or token in request.eos_token_ids):
            return output


class FakeModel:
    """Stands in for the model runner: a paged KV cache of token ids, written and read via block tables."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.slots = [[None] * kv.block_size for _ in range(kv.num_total_blocks)]
        self.num_forwards = 0

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        pool, bs = self.kv.block_pool, self.kv.block_size
        sources = [list(self.slots[src]) for src, _ in output.copy_on_write]  # one batched gather/scatter
        for (_, dst), data in zip(output.copy_on_write, sources):
            self.slots[dst] = data
        live = [item for item in output.scheduled if not item.request.is_finished]  # aborted mid-step
        for item in live:
            end = item.num_computed_tokens + item.num_new_tokens
            assert len(item.block_table) == cdiv(end, bs), "table must cover exactly the computed tokens"
            for position, token in zip(item.positions, item.token_ids):
                block = item.block_table[position // bs]
                assert pool.ref_count(block) == 1, "write into a shared block without copy-on-write"
                assert pool.block_hash(block) is None, "write into a prefix-cached block"
                self.slots[block][position % bs] = token
        sampled = {}
        for item in live:
            end = item.num_computed_tokens + item.num_new_tokens
            context = [self.slots[item.block_table[p // bs]][p % bs] for p in range(end)]
            assert context == item.request.all_token_ids[:end], "KV read through the table is wrong"
            if item.needs_sample:
                sampled[item.request_id] = next_token(context, item.request.sample_index)
        self.num_forwards += 1
        return sampled


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                   chunked=True, prefix_caching=True) -> tuple[Scheduler, FakeModel]:
    kv = KVCacheManager(num_blocks, BS, prefix_caching)
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, chunked)
    return Scheduler(config, kv), FakeModel(kv)


def make_request(request_id: str, prompt, max_tokens: int = 4, parent_id=None, sample_index=0,
                 eos=()) -> Request:
    prompt = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=tuple(eos),
                   parent_id=parent_id, sample_index=sample_index)


def finish_if_done(scheduler: Scheduler, request: Request) -> None:
    """The engine's stop checks (lead's loop): length, context/cache cap, EOS."""
    if (request.num_output_tokens >= request.sampling_params.max_tokens
            or request.num_tokens >= scheduler.max_request_tokens):
        scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    elif request.output_token_ids[-1] in request.eos_token_ids:
        scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)


def step(scheduler: Scheduler, model: FakeModel) -> SchedulerOutput:
    output = scheduler.schedule()
    check_step_invariants(scheduler, output)
    sampled = model.execute(output)
    for request in scheduler.update_after_step(output, sampled):
        finish_if_done(scheduler, request)
    check_state_invariants(scheduler)
    return output


def run_to_completion(scheduler: Scheduler, model: FakeModel, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler, model)
    raise AssertionError("requests did not finish")


def check_step_invariants(scheduler: Scheduler, output: SchedulerOutput) -> None:
    config = scheduler.config
    assert output.num_batched_tokens == sum(item.num_new_tokens for item in output.scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.scheduled) <= config.max_num_seqs and scheduler.num_running <= config.max_num_seqs
    assert len({item.request_id for item in output.scheduled}) == len(output.scheduled)
    assert all(item.num_new_tokens > 0 for item in output.scheduled)


def check_state_invariants(scheduler: Scheduler) -> None:
    """Blocks are accounted for exactly: refs == table memberships, waste < 1 block per running request."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    assert pool.num_free_blocks + pool.num_cached_blocks + pool.num_used_blocks == pool.num_total_blocks
    refs = [0] * pool.num_total_blocks
    for request in scheduler.running:
        table = kv.get_block_table(request.request_id)
        assert len(table) == cdiv(request.num_computed_tokens, BS)  # waste < one block
        assert request.num_computed_tokens < request.num_tokens  # a token is always left to compute
        for block in table:
            refs[block] += 1
    for request in scheduler.waiting:
        assert kv.get_block_table(request.request_id) == []
        assert request.num_computed_tokens == 0
    assert refs == [pool.ref_count(b) for b in range(pool.num_total_blocks)]
    assert pool.num_used_blocks == sum(1 for r in refs if r > 0)


def assert_all_blocks_returned(scheduler: Scheduler) -> None:
    stats = scheduler.stats()
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]
    assert stats["kv_cache_usage"] == 0.0
    pool = scheduler.kv_cache_manager.block_pool
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_total_blocks))


# ---- admission checks ---------------------------------------------------------------------------------

def test_rejects_requests_that_can_never_run():
    scheduler, _ = make_scheduler(num_blocks=8, max_model_len=40)  # cache: 8 blocks = 32 tokens
    cases = [
        (make_request("empty", []), "prompt"),
        (make_request("long", 41), "prompt"),
        (make_request("big_prompt", 33, max_tokens=1), "prompt"),
        (make_request("big_total", 20, max_tokens=13), "max_tokens"),
    ]
    for request, param in cases:
        with pytest.raises(EngineError) as error:
            scheduler.add_request(request)
        assert error.value.param == param and error.value.message
    with pytest.raises(EngineError) as error:
        scheduler.add_request(make_request("chat", []), prompt_param="messages")
    assert error.value.param == "messages"
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("fits", 20, max_tokens=12))  # exactly 32 tokens: 8 blocks
    with pytest.raises(EngineError):
        scheduler.add_request(make_request("fits", 3))  # duplicate id
    assert scheduler.num_waiting == 1


def test_config_without_chunking_needs_a_budget_for_a_whole_prompt():
    with pytest.raises(EngineError) as error:
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32,
                        enable_chunked_prefill=False)
    assert error.value.param == "max_num_batched_tokens"
    with pytest.raises(EngineError):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=16, max_model_len=16)


# ---- batching -----------------------------------------------------------------------------------------

def test_chunked_prefill_splits_a_long_prompt_by_the_budget():
    scheduler, model = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", 20, max_tokens=3)
    scheduler.add_request(request)
    chunks, got_token = [], []
    while scheduler.has_unfinished_requests():
        output = step(scheduler, model)
        chunks.append([item.num_new_tokens for item in output.scheduled])
        got_token.append(request.num_output_tokens)
    assert chunks == [[8], [8], [4], [1], [1]]  # 20 = 8 + 8 + 4, then two decodes
    assert got_token == [0, 0, 1, 2, 3]  # no token sampled for a chunk that does not end the prompt
    assert request.output_token_ids == reference_output(request, 64)
    assert request.first_token_time is not None and request.status == RequestStatus.FINISHED_LENGTH


def test_decodes_are_scheduled_before_new_prefills():
    scheduler, model = make_scheduler(max_num_batched_tokens=8)
    first = make_request("first", 4, max_tokens=5)
    scheduler.add_request(first)
    step(scheduler, model)  # first: prefill done, now decoding
    second = make_request("second", 20)
    scheduler.add_request(second)
    for _ in range(2):
        output = step(scheduler, model)
        assert [(item.request_id, item.num_new_tokens) for item in output.scheduled] == [
            ("first", 1), ("second", 7)]
    run_to_completion(scheduler, model)
    assert second.output_token_ids == reference_output(second, 64)


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    scheduler, model = make_scheduler(max_num_batched_tokens=10, max_model_len=10, chunked=False)
    first, second = make_request("first", 3, max_tokens=3), make_request("second", 10, max_tokens=1)
    scheduler.add_request(first)
    step(scheduler, model)
    scheduler.add_request(second)
    output = step(scheduler, model)  # 1 decode + 10 prompt tokens > 10: the prompt is not split
    assert [item.request_id for item in output.scheduled] == ["first"] and scheduler.num_waiting == 1
    run_to_completion(scheduler, model)
    assert second.output_token_ids == reference_output(second, 10)


def test_max_num_seqs_caps_the_running_set():
    scheduler, model = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", 3, max_tokens=2 + i) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output = step(scheduler, model)
    assert [item.request_id for item in output.scheduled] == ["r0", "r1"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    step(scheduler, model)  # r0 reaches max_tokens=2 and leaves
    output = step(scheduler, model)
    assert [item.request_id for item in output.scheduled] == ["r1", "r2"]
    run_to_completion(scheduler, model)
    assert all(r.output_token_ids == reference_output(r, 64) for r in requests)


def test_update_returns_only_requests_that_got_a_token():
    scheduler, model = make_scheduler(max_num_batched_tokens=6)
    short, long = make_request("short", 2), make_request("long", 9)
    scheduler.add_request(short)
    scheduler.add_request(long)
    output = scheduler.schedule()  # short: 2 tokens (done), long: first 4 of 9
    assert [item.needs_sample for item in output.scheduled] == [True, False]
    got = scheduler.update_after_step(output, model.execute(output))
    assert [r.request_id for r in got] == ["short"]
    assert long.num_output_tokens == 0 and long.first_token_time is None and long.num_computed_tokens == 4


# ---- preemption ---------------------------------------------------------------------------------------

def test_preemption_takes_the_newest_running_requests_first():
    scheduler, model = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    requests = [make_request("a", 12, max_tokens=6), make_request("b", 4, max_tokens=6),
                make_request("c", range(20, 24), max_tokens=6),
                make_request("d", range(30, 34), max_tokens=6)]
    for request in requests:
        scheduler.add_request(request)
    step(scheduler, model)  # 3 + 1 + 1 + 1 blocks: the pool is full
    assert scheduler.stats()["num_free_blocks"] == 0
    output = step(scheduler, model)
    # a needs a 4th block -> d (newest) goes; b needs a 2nd block -> c goes
    assert [r.request_id for r in output.preempted] == ["d", "c"]
    assert [item.request_id for item in output.scheduled] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]  # front of the line, in admission order
    for request in requests[2:]:
        assert request.status == RequestStatus.PREEMPTED
        assert request.num_computed_tokens == 0 and request.num_preemptions == 1
        assert request.num_output_tokens == 1  # what it generated is kept and recomputed
        assert scheduler.kv_cache_manager.get_block_table(request.request_id) == []
    assert scheduler.stats()["num_preemptions"] == 2
    run_to_completion(scheduler, model)
    assert all(r.output_token_ids == reference_output(r, 64) for r in requests)
    assert_all_blocks_returned(scheduler)


def test_a_request_that_is_itself_the_newest_preempts_itself():
    scheduler, model = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    a, b = make_request("a", 7, max_tokens=3), make_request("b", range(10, 18), max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, model)  # 2 + 2 blocks
    output = step(scheduler, model)  # a writes position 7 (its block 1); b needs a 3rd block: none left
    assert [r.request_id for r in output.preempted] == ["b"]
    assert [item.request_id for item in output.scheduled] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and a.num_preemptions == 0
    run_to_completion(scheduler, model)
    assert a.output_token_ids == reference_output(a, 64) and b.output_token_ids == reference_output(b, 64)


def test_recompute_after_preemption_reuses_its_cached_blocks():
    scheduler, model = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    a, b = make_request("a", 8, max_tokens=6), make_request("b", range(10, 18), max_tokens=6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, model)  # 2 + 2 blocks; b's two full blocks are now in the prefix cache
    step(scheduler, model)  # a takes block 5 -> b has no block for position 8 -> b preempted
    assert b.status == RequestStatus.PREEMPTED
    queries = scheduler.stats()["prefix_cache_queries"]
    run_to_completion(scheduler, model)
    stats = scheduler.stats()
    assert stats["prefix_cache_queries"] > queries and stats["prefix_cache_hits"] >= 4
    assert b.output_token_ids == reference_output(b, 64)


def test_a_request_longer_than_the_whole_cache_is_ended_not_looped():
    """If the engine lets a request outgrow the cache, the scheduler ends it (length) instead of spinning."""
    scheduler, model = make_scheduler(num_blocks=2, max_num_batched_tokens=64, max_model_len=64)
    request = make_request("a", 6, max_tokens=None)
    scheduler.add_request(request)
    for _ in range(10):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()  # no max_request_tokens check here, on purpose
        scheduler.update_after_step(output, model.execute(output))
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_tokens == 9
    assert output.finished == [request]
    assert scheduler.max_request_tokens == 8
    assert_all_blocks_returned(scheduler)


# ---- prefix cache and n > 1 ---------------------------------------------------------------------------

def test_shared_system_prompt_hits_the_prefix_cache():
    scheduler, model = make_scheduler()
    system = list(range(100, 112))  # 3 full blocks
    first = make_request("first", system + [1, 2, 3, 4], max_tokens=2)
    scheduler.add_request(first)
    run_to_completion(scheduler, model)
    second = make_request("second", system + [5, 6, 7, 8, 9], max_tokens=3)
    scheduler.add_request(second)
    output = step(scheduler, model)
    assert second.num_cached_tokens == 12
    assert [(item.num_computed_tokens, item.num_new_tokens) for item in output.scheduled] == [(12, 5)]
    stats = scheduler.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (16 + 17, 0 + 12)
    run_to_completion(scheduler, model)
    assert second.output_token_ids == reference_output(second, 64)


def test_prefix_caching_off_computes_everything_and_gives_the_same_tokens():
    outputs = {}
    for caching in (True, False):
        scheduler, model = make_scheduler(prefix_caching=caching)
        requests = [make_request(f"r{i}", list(range(100, 112)) + [i], max_tokens=3) for i in range(3)]
        for request in requests:
            scheduler.add_request(request)
            run_to_completion(scheduler, model)
        outputs[caching] = [r.output_token_ids for r in requests]
        assert scheduler.stats()["prefix_cache_hits"] == (24 if caching else 0)
    assert outputs[True] == outputs[False]


def test_n_samples_fork_the_parent_prompt_and_copy_on_write():
    scheduler, model = make_scheduler()
    parent = make_request("g-0", 10, max_tokens=4, parent_id="g", sample_index=0)
    child = make_request("g-1", 10, max_tokens=4, parent_id="g", sample_index=1)
    scheduler.add_request(parent)
    scheduler.add_request(child)
    output = step(scheduler, model)
    assert [item.request_id for item in output.scheduled] == ["g-0"]  # the child waits for the prompt KV
    output = step(scheduler, model)
    assert [(item.request_id, item.num_computed_tokens, item.num_new_tokens)
            for item in output.scheduled] == [("g-0", 10, 1), ("g-1", 9, 1)]
    kv = scheduler.kv_cache_manager
    parent_table, child_table = kv.get_block_table("g-0"), kv.get_block_table("g-1")
    assert child_table[:2] == parent_table[:2]  # the two full prompt blocks are shared
    assert output.copy_on_write == [(parent_table[2], child_table[2])]  # position 9 lives in block 2
    assert child.num_cached_tokens == 9
    run_to_completion(scheduler, model)
    assert parent.output_token_ids == reference_output(parent, 64)
    assert child.output_token_ids == reference_output(child, 64)
    assert parent.output_token_ids != child.output_token_ids
    assert_all_blocks_returned(scheduler)


def test_a_sample_whose_parent_is_gone_does_a_normal_prefill():
    scheduler, model = make_scheduler()
    parent = make_request("g-0", 10, max_tokens=1, parent_id="g", sample_index=0)
    child = make_request("g-1", 10, max_tokens=3, parent_id="g", sample_index=1)
    scheduler.add_request(parent)
    scheduler.add_request(child)
    step(scheduler, model)  # the parent's one token: it is finished and its blocks freed
    assert parent.is_finished
    output = step(scheduler, model)
    assert [(item.num_computed_tokens, item.num_new_tokens) for item in output.scheduled] == [(8, 2)]
    assert output.copy_on_write == []
    run_to_completion(scheduler, model)
    assert child.output_token_ids == reference_output(child, 64)


# ---- abort and finish ---------------------------------------------------------------------------------

def test_abort_in_every_state_frees_everything():
    scheduler, model = make_scheduler(num_blocks=8, max_num_batched_tokens=8)
    decoding = make_request("decoding", 4, max_tokens=24)
    scheduler.add_request(decoding)
    step(scheduler, model)
    chunked = make_request("chunked", 20, max_tokens=12)
    scheduler.add_request(chunked)
    step(scheduler, model)  # chunked prefill in progress
    assert chunked.status == RequestStatus.RUNNING and 0 < chunked.num_computed_tokens < 20
    waiting = make_request("waiting", 5)
    parent = make_request("g-0", 6, parent_id="g", max_tokens=20)
    child = make_request("g-1", 6, parent_id="g", sample_index=1, max_tokens=20)
    for request in (waiting, parent, child):
        scheduler.add_request(request)
    for _ in range(6):
        step(scheduler, model)
    preempted = [r for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED]
    assert preempted, "the small pool should have forced a preemption"
    assert scheduler.stats()["num_used_blocks"] > 0

    output = scheduler.schedule()  # abort between schedule and update: the step's result is dropped
    in_flight = output.scheduled[0].request
    scheduler.abort_request(in_flight.request_id)
    sampled = model.execute(output)
    got = scheduler.update_after_step(output, sampled)
    assert in_flight not in got and in_flight.status == RequestStatus.FINISHED_ABORTED

    for request in (decoding, chunked, waiting, parent, child):
        scheduler.abort_request(request.request_id)
        assert request.status == RequestStatus.FINISHED_ABORTED
        check_state_invariants(scheduler)
    scheduler.abort_request("no-such-request")
    assert not scheduler.has_unfinished_requests() and scheduler.get_request("decoding") is None
    assert_all_blocks_returned(scheduler)


def test_finish_request_removes_it_from_the_ui_table():
    scheduler, model = make_scheduler()
    a, b = make_request("a", 5, max_tokens=10), make_request("b", 6, max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, model)
    rows = {row.request_id: row for row in scheduler.request_rows()}
    assert rows["a"].num_blocks == 2 and rows["a"].state == "running" and rows["a"].num_output_tokens == 1
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert [r.request_id for r in scheduler.running_requests()] == ["b"]
    assert a.status == RequestStatus.FINISHED_STOPPED and scheduler.num_running == 1
    with pytest.raises(ValueError):
        scheduler.finish_request("b", RequestStatus.RUNNING)


# ---- randomized simulation ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_random_workload_keeps_every_invariant_and_exact_outputs(seed):
    rng = random.Random(seed)
    max_model_len = 48
    scheduler, model = make_scheduler(
        num_blocks=rng.choice([12, 16, 24, 40]), max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([48, 64]) if seed % 4 == 3 else rng.choice([5, 8, 16, 48]),
        max_model_len=max_model_len, chunked=seed % 4 != 3, prefix_caching=seed % 2 == 0)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    all_requests: list[Request] = []
    aborted: set[str] = set()
    for step_index in range(250):
        if rng.random() < 0.35 and len(all_requests) < 60:
            all_requests += add_random_group(scheduler, rng, prefixes, f"s{step_index}")
        if rng.random() < 0.05 and all_requests:
            victim = rng.choice(all_requests)
            if not victim.is_finished:
                aborted.add(victim.request_id)
            scheduler.abort_request(victim.request_id)
        if scheduler.has_unfinished_requests():
            step(scheduler, model)
    run_to_completion(scheduler, model)
    assert_all_blocks_returned(scheduler)
    for request in all_requests:
        assert request.is_finished
        if request.request_id not in aborted:
            assert request.output_token_ids == reference_output(request, max_model_len), request.request_id


def add_random_group(scheduler: Scheduler, rng: random.Random, prefixes, name: str) -> list[Request]:
    """One request, or an n>1 group, often sharing a system prompt; rejected ones are dropped."""
    prompt = list(rng.choice(prefixes)) if rng.random() < 0.6 else []
    prompt += [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))]
    max_tokens = rng.randrange(1, 16)
    eos = (EOS,) if rng.random() < 0.5 else ()
    n = rng.choice([1, 1, 1, 2, 3])
    group = [make_request(f"{name}-{i}", prompt, max_tokens=max_tokens, eos=eos,
                          parent_id=name if n > 1 else None, sample_index=i) for i in range(n)]
    added = []
    for request in group:
        try:
            scheduler.add_request(request)
            added.append(request)
        except EngineError:
            pass
    return added


def test_random_workloads_exercise_preemption_forks_and_hits():
    """The simulation above is only convincing if it actually hits the hard paths."""
    totals = {"preemptions": 0, "copies": 0, "hits": 0}
    for seed in range(4):
        rng = random.Random(100 + seed)
        scheduler, model = make_scheduler(num_blocks=14, max_num_seqs=6, max_num_batched_tokens=16,
                                          max_model_len=48)
        prefixes = [[rng.randrange(1, VOCAB) for _ in range(10)]]
        for step_index in range(150):
            if rng.random() < 0.4:
                add_random_group(scheduler, rng, prefixes, f"s{step_index}")
            if scheduler.has_unfinished_requests():
                totals["copies"] += len(step(scheduler, model).copy_on_write)
        run_to_completion(scheduler, model)
        assert_all_blocks_returned(scheduler)
        totals["preemptions"] += scheduler.stats()["num_preemptions"]
        totals["hits"] += scheduler.stats()["prefix_cache_hits"]
    assert all(value > 0 for value in totals.values()), totals
