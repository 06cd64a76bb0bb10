"""Model switching: requests in flight end (completed or with a clear "model switched" error), nothing leaks, and
a load that fails leaves the old model serving. In-process AsyncEngine, plus the /v1/models/load|unload routes.

The switching test goes back and forth between the default fp16 model and its bundled AWQ build; other tests use
the default model's files symlinked into another folder (served under that folder's name).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time

import httpx
import psutil
import pytest
from server_process import free_port

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.errors import EngineError, ModelSwitchedError, NoModelLoadedError
from engine.request import SamplingParams
from engine.serving.server import ServerSettings, ServerThread, build_app

LONG = SamplingParams(max_tokens=600, ignore_eos=True, temperature=0.8)  # cannot finish during a switch
SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("models") / "smollm2-copy"
    folder.mkdir()
    for item in default_model_dir.iterdir():
        if item.is_file():
            os.symlink(item, folder / item.name)
    return folder


@pytest.fixture(scope="module")
def broken_model_dir(tmp_path_factory, default_model_dir):
    """A folder that passes every cheap check (config.json, tokenizer) but has no weights."""
    folder = tmp_path_factory.mktemp("models") / "no-weights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def engine(default_model_dir):
    engine = AsyncEngine(EngineArgs(model=str(default_model_dir), dtype="float32", kv_cache_memory="32MiB"))
    yield engine
    engine.shutdown()


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pagoda-engine-") and t.is_alive()]


async def consume(engine: AsyncEngine, params: SamplingParams, started: asyncio.Event | None = None):
    """Run one request to its end: ('completed', finish_reason) or ('switched' / 'unloaded', message)."""
    try:
        async for output in engine.generate("Write a story about a lighthouse.", params):
            if started is not None and output.outputs[0].token_ids:
                started.set()
            if output.finished:
                return "completed", output.outputs[0].finish_reason
        return "ended", None
    except ModelSwitchedError as exc:
        return "switched", exc.message
    except NoModelLoadedError as exc:
        return "unloaded", exc.message


def test_idle_loop_sleeps_and_cancel_aborts_at_once(engine):
    """The loop thread burns no CPU while idle; a cancelled consumer's request leaves the engine right away."""
    (thread,) = engine_threads()
    cpu = {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    time.sleep(1.0)
    cpu_after = {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    assert cpu_after[thread.native_id] - cpu[thread.native_id] < 0.05

    async def scenario():
        started = asyncio.Event()
        task = asyncio.create_task(consume(engine, LONG, started))
        await asyncio.wait_for(started.wait(), 60)
        aborted = engine.stats()["request_success_total"].get("abort", 0)
        task.cancel()
        deadline = time.monotonic() + 5
        while engine.stats()["num_running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return aborted

    aborted_before = asyncio.run(scenario())
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0
    assert stats["request_success_total"]["abort"] == aborted_before + 1


def test_bad_input_raises_engine_error_before_any_output(engine):
    async def first_output(prompt_token_ids, params):
        async for output in engine.generate(params=params, prompt_token_ids=prompt_token_ids):
            return output

    too_long = [1] * (engine.max_model_len + 1)
    with pytest.raises(EngineError) as info:
        asyncio.run(first_output(too_long, SHORT))
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(EngineError) as info:
        asyncio.run(first_output([1, 2, 3], SamplingParams(max_tokens=2, logit_bias={10**9: 1.0})))
    assert info.value.param == "logit_bias"
    assert engine.stats()["num_waiting"] == 0


async def switch_with_requests_in_flight(engine: AsyncEngine, target, num_requests: int = 4):
    started = [asyncio.Event() for _ in range(num_requests)]
    tasks = [asyncio.create_task(consume(engine, LONG, ev)) for ev in started]
    await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
    short = asyncio.create_task(consume(engine, SHORT))
    info = await engine.switch_model(str(target))
    results = await asyncio.wait_for(asyncio.gather(*tasks, short), 60)  # nobody hangs
    return info, results


def test_ten_switches_between_fp16_and_awq_with_requests_in_flight(engine, default_model_dir, awq_model_dir):
    process = psutil.Process()
    rss = []
    for target in [awq_model_dir, default_model_dir] * 5:
        info, results = asyncio.run(switch_with_requests_in_flight(engine, target, num_requests=2))
        assert info.model == target.name == engine.model_name
        long_results, short_result = results[:-1], results[-1]
        assert all(r == ("switched", f"model switched to {target.name}") for r in long_results), long_results
        assert short_result[0] in ("completed", "switched")  # a short request may finish before the switch
        assert asyncio.run(consume(engine, SHORT)) == ("completed", "length")  # the new model serves
        assert len(engine_threads()) == 1  # the old loop thread is gone
        stats = engine.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0
        rss.append(process.memory_info().rss)
    # An old model's weights (540 MB in fp32) are not kept: memory after the tenth load is near the second's
    # (same model, fp16 default; the first AWQ load is rss[0]).
    assert rss[-1] - rss[1] < 250 * 2**20, [r / 2**20 for r in rss]
    assert rss[-2] - rss[0] < 250 * 2**20, [r / 2**20 for r in rss]


def test_failed_load_keeps_the_old_model_serving(engine, broken_model_dir, tmp_path):
    serving = engine.model_name

    async def scenario(target: str):
        in_flight = asyncio.create_task(consume(engine, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
        await asyncio.sleep(0)
        with pytest.raises(EngineError):
            await engine.switch_model(target)
        return await asyncio.wait_for(in_flight, 60)

    for target in ("/nonexistent/model/folder", str(tmp_path), str(broken_model_dir)):
        assert asyncio.run(scenario(target)) == ("completed", "length")
        assert engine.model_name == serving and len(engine_threads()) == 1
    with pytest.raises(EngineError):  # unknown engine arguments are refused before anything happens
        engine.switch_model_sync(serving, max_model_length=100)
    assert engine.model_name == serving


def test_release_first_mode_restores_the_old_model_when_the_load_fails(engine, broken_model_dir):
    """The CUDA default frees the old model before loading; a failed load then reloads the old one."""
    serving = engine.model_name

    async def scenario():
        started = asyncio.Event()
        in_flight = asyncio.create_task(consume(engine, LONG, started))
        await asyncio.wait_for(started.wait(), 60)
        with pytest.raises(EngineError):
            await engine.switch_model(str(broken_model_dir), release_first=True)
        return await asyncio.wait_for(in_flight, 60)

    outcome, message = asyncio.run(scenario())
    assert outcome == "switched" and "unloaded" in message
    assert engine.model_name == serving and len(engine_threads()) == 1
    assert asyncio.run(consume(engine, SHORT)) == ("completed", "length")
    with pytest.raises(EngineError):  # an obvious mistake is caught before the served model is dropped
        engine.switch_model_sync("/nonexistent/model/folder", release_first=True)
    assert engine.llm_engine is not None and engine.model_name == serving


def _sse_stream(url: str, body: dict, events: list, started: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) >= 3:
                    started.set()


def test_load_and_unload_routes(engine, default_model_dir, second_model_dir, broken_model_dir):
    app = build_app(engine, ServerSettings(), owns_engine=False)
    with ServerThread(app, free_port()) as url:
        http = httpx.Client(base_url=url, timeout=120)
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

        # Switch under a live SSE stream: the stream ends with an error event, then [DONE].
        events, started = [], threading.Event()
        body = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 600, "ignore_eos": True}
        reader = threading.Thread(target=_sse_stream, args=(url, body, events, started))
        reader.start()
        assert started.wait(60)
        target = second_model_dir if engine.model_name != second_model_dir.name else default_model_dir
        r = http.post("/v1/models/load", json={"model": str(target)})
        assert r.status_code == 200 and r.json()["id"] == target.name, r.text
        reader.join(60)
        assert not reader.is_alive() and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "model_switched" and target.name in error["message"]
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [target.name]

        # Bad loads: 4xx with a reason, and the model keeps serving.
        for bad, status in (("/nonexistent/folder", 404), ("relative/folder", 404), ("../../etc", 404),
                            (str(broken_model_dir), 400)):
            r = http.post("/v1/models/load", json={"model": bad})
            assert r.status_code == status and r.json()["error"]["param"] == "model", (bad, r.text)
        r = http.post("/v1/models/load", json={"model": str(target), "max_model_len": "long"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_model_len"
        assert http.post("/v1/chat/completions", json={**chat, "model": target.name}).status_code == 200

        # Unload: 503 with a clear message until something is loaded again.
        assert http.post("/v1/models/unload").json()["status"] == "unloaded"
        assert engine_threads() == []
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_model_loaded"
        assert http.get("/v1/models").json()["data"] == []
        assert 'pagoda:model_loaded{model_name=""} 0.0' in http.get("/metrics").text
        r = http.post("/v1/models/load", json={"model": str(default_model_dir)})
        assert r.status_code == 200 and r.json()["previous"] is None
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["model"] == default_model_dir.name
    assert len(engine_threads()) == 1


def test_shutdown_leaves_no_threads(default_model_dir):
    before = {t.ident for t in threading.enumerate()}
    engine = AsyncEngine(EngineArgs(model=str(default_model_dir), dtype="float32", kv_cache_memory="16MiB"),
                         load=False)
    assert engine.model_name is None
    with pytest.raises(NoModelLoadedError):
        engine.tokenizer  # noqa: B018
    assert asyncio.run(consume(engine, SHORT))[0] == "unloaded"
    engine.switch_model_sync(str(default_model_dir))
    assert asyncio.run(consume(engine, SHORT)) == ("completed", "length")
    engine.shutdown()
    engine.shutdown()
    deadline = time.monotonic() + 5
    while {t.ident for t in threading.enumerate()} - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {t.name for t in threading.enumerate() if t.ident not in before} == set()
