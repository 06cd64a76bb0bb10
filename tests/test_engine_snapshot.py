"""The engine loop's snapshot is the only thing other threads read.

Under load (many concurrent requests on the CPU default model, some with two samples, some cancelled mid-way, a KV
cache small enough to preempt), the UI client's dashboard and a Prometheus scrape poll from their own threads. The
engine is instrumented: every call into its internals (step, admission, aborts, the scheduler's request rows, the
memory report, snapshots) records its thread, and all of them must come from the engine loop thread. Each
snapshot a reader gets must be consistent with itself (rows against counts, blocks against the pool) and never go
back in time against the one before; a reader that raises fails the test (their code has no retries to hide it).
"""

from __future__ import annotations

import asyncio
import functools
import random
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.request import SamplingParams
from ui.client import EngineClient
from ui.model_manager import ModelManager

NUM_REQUESTS = 24
MAX_TOKENS = 12


def instrumented_loader(calls: dict[str, set[str]]):
    """Build a real LLMEngine, then record the thread of every call into what only its loop may touch."""

    def load(args: EngineArgs):
        from engine.llm_engine import LLMEngine

        engine = LLMEngine(args)
        targets = [(engine, name) for name in ("step", "add_request", "abort_request", "snapshot", "stats",
                                                "memory_report", "has_unfinished_requests")]
        targets += [(engine.scheduler, name) for name in ("request_rows", "schedule", "stats")]
        for obj, name in targets:
            original = getattr(obj, name)

            @functools.wraps(original)
            def recorded(*args, __original=original, __name=name, **kwargs):
                calls.setdefault(__name, set()).add(threading.current_thread().name)
                return __original(*args, **kwargs)

            setattr(obj, name, recorded)
        return engine

    return load


def check_dashboard(snap, previous) -> None:
    s = snap.stats
    rows = snap.rows
    assert len(rows) == s["num_running"] + s["num_waiting"], (len(rows), s)
    assert [r.state for r in rows[:s["num_running"]]] == ["running"] * s["num_running"]
    assert all(r.state in ("waiting", "preempted") for r in rows[s["num_running"]:])
    used, total = s["num_used_blocks"], s["num_total_blocks"]
    assert used + s["num_free_blocks"] + s["num_cached_blocks"] == total
    assert s["kv_cache_usage"] == pytest.approx(used / total)
    assert max((r.blocks for r in rows), default=0) <= used <= sum(r.blocks for r in rows)
    assert all(r.output_tokens <= MAX_TOKENS for r in rows)
    assert len({r.request_id for r in rows}) == len(rows)
    memory = snap.memory
    assert memory is not None and 0 <= memory["kv_in_use"] <= memory["kv_allocated"]
    if previous is not None:
        p = previous.stats
        for key in ("generation_tokens_total", "prompt_tokens_total", "num_preemptions", "prefix_cache_queries"):
            assert s[key] >= p[key], key
        for reason, count in p["request_success_total"].items():
            assert s["request_success_total"].get(reason, 0) >= count


def scrape(engine: AsyncEngine) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(engine.metrics.render().decode()):
        for sample in family.samples:
            key = sample.name + "".join(f"|{v}" for k, v in sorted(sample.labels.items()) if k == "finished_reason")
            values[key] = sample.value
    return values


def check_scrape(values: dict[str, float], previous: dict[str, float] | None) -> None:
    total = values["pagoda:kv_cache_total_blocks"]
    used = total - values["pagoda:kv_cache_free_blocks"] - values["pagoda:kv_cache_cached_blocks"]
    assert values["vllm:kv_cache_usage_perc"] == pytest.approx(used / total)
    assert values["vllm:num_requests_running"] >= 0 and values["vllm:num_requests_waiting"] >= 0
    assert values["pagoda:memory_bytes"] >= 0
    if previous is not None:
        for key, value in values.items():
            if key.endswith("_total") or key.startswith("vllm:request_success"):
                assert value >= previous.get(key, 0), key


def poll(name: str, read, check, stop: threading.Event, errors: list, counts: dict) -> None:
    previous = None
    while not stop.is_set():
        try:
            value = read()
            check(value, previous)
        except BaseException as exc:  # noqa: BLE001 -- handed to the main thread, which fails the test
            errors.append((name, exc))
            return
        previous = value
        counts[name] = counts.get(name, 0) + 1
        time.sleep(0.02)  # poll often, yet leave the engine loop the interpreter most of the time


async def load(engine: AsyncEngine) -> list[str]:
    rng = random.Random(0)

    async def one(i: int) -> str:
        params = SamplingParams(max_tokens=rng.randint(4, MAX_TOKENS), temperature=1.0, seed=i, ignore_eos=True,
                                n=2 if i % 5 == 0 else 1)
        prompt = "Tell me about the sea. " * rng.randint(1, 8)
        outputs = engine.generate(prompt, params)
        try:
            async for output in outputs:
                if i % 7 == 3 and output.outputs[0].token_ids:
                    return "cancelled"  # leaving early aborts the request
                if output.finished:
                    return "finished"
        finally:
            await outputs.aclose()
        return "ended"

    tasks = []
    for i in range(NUM_REQUESTS):
        tasks.append(asyncio.create_task(one(i)))
        if i % 8 == 7:
            await asyncio.sleep(0.05)  # arrivals spread over the first steps
    return await asyncio.gather(*tasks)


def test_ui_and_metrics_read_only_snapshots_while_the_loop_runs_under_load(default_model_dir, tmp_path):
    calls: dict[str, set[str]] = {}
    engine = AsyncEngine(EngineArgs(model=str(default_model_dir), kv_cache_memory="6MiB", max_num_seqs=16,
                                    max_num_batched_tokens=256, seed=0),
                         model_loader=instrumented_loader(calls))
    client = EngineClient(engine, models=ModelManager(engine, state_path=tmp_path / "models.json"),
                          sample_interval=0.05)
    stop, errors, counts = threading.Event(), [], {}
    readers = [threading.Thread(target=poll, args=("dashboard", client.dashboard, check_dashboard, stop, errors,
                                                   counts), name="ui-reader"),
               threading.Thread(target=poll, args=("metrics", lambda: scrape(engine), check_scrape, stop, errors,
                                                   counts), name="metrics-reader")]
    try:
        for thread in readers:
            thread.start()
        started = time.monotonic()
        results = asyncio.run(load(engine))
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        for thread in readers:
            thread.join(30)
        client.close()
        engine.shutdown()

    print(f"\n{NUM_REQUESTS} requests in {elapsed:.1f} s; reads: {counts}")
    assert not errors, errors
    assert results.count("finished") + results.count("cancelled") == NUM_REQUESTS
    assert counts.get("dashboard", 0) > 10 and counts.get("metrics", 0) > 10, (counts, elapsed)
    loop_threads = {name for names in calls.values() for name in names}
    assert calls["step"] and calls["request_rows"] and calls["memory_report"]
    assert all(name.startswith("pagoda-engine-") for name in loop_threads), calls


def test_an_idle_loop_refreshes_an_old_memory_report_when_asked(default_model_dir):
    engine = AsyncEngine(EngineArgs(model=str(default_model_dir), kv_cache_memory="4MiB"))
    try:
        first = engine.snapshot()
        assert first is not None and first.memory is not None and first.requests == ()
        time.sleep(0.05)
        assert engine.snapshot() is first  # idle: nothing new is published on its own
        fresh = engine.snapshot(max_memory_age=0.01, wait=5.0)
        assert fresh is not first and fresh.memory.taken_at > first.memory.taken_at
        assert fresh.step == first.step  # no engine step ran for it
    finally:
        engine.shutdown()
    assert engine.snapshot() is None
