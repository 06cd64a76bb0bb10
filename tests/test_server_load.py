"""Load: 64 concurrent streaming chats, a third of them dropped mid-stream; nothing leaks and the server answers.

A user sees this as: every stream that stays connected completes with a finish_reason and exact usage, the
abandoned ones stop costing anything at once (aborted in the engine, their KV blocks freed), and /metrics
returns to an idle server (0 running, 0 waiting, 0% KV in use).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from server_process import launch_server

NUM_STREAMS = 64
MAX_TOKENS = 12
DROP_EVERY = 3  # streams 0, 3, 6, ... disconnect after their first content chunk


@pytest.fixture(scope="module")
def server(default_model_dir):
    with launch_server(default_model_dir, ui=False) as url:
        yield url


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total, found = total + float(match.group(2)), True
    assert found, f"{name} {labels} not in /metrics"
    return total


async def one_chat(client: httpx.AsyncClient, i: int) -> dict:
    """Stream one chat; the dropped ones ask for many tokens (ignore_eos) so they cannot finish before leaving."""
    drop = i % DROP_EVERY == 0
    body = {"messages": [{"role": "user", "content": f"Write a short note about the number {i}."}],
            "max_tokens": 400 if drop else MAX_TOKENS, "ignore_eos": drop, "temperature": 0.7, "seed": i,
            "stream": True, "stream_options": {"include_usage": True}}
    result = {"drop": drop, "text": "", "finish": None, "usage": None, "done": False}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                result["text"] += choice["delta"].get("content") or ""
                result["finish"] = choice["finish_reason"] or result["finish"]
            if drop and result["text"]:
                break  # leaving the `async with` closes the connection mid-stream
    return result


async def run_load(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_STREAMS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300), limits=limits) as client:
        return await asyncio.gather(*(one_chat(client, i) for i in range(NUM_STREAMS)))


def wait_idle(url: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics").text
        busy = metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_64_streams_with_a_third_dropped_leave_no_trace(server):
    started = time.monotonic()
    results = asyncio.run(run_load(server))
    elapsed = time.monotonic() - started
    kept = [r for r in results if not r["drop"]]
    dropped = [r for r in results if r["drop"]]
    assert len(dropped) == (NUM_STREAMS + DROP_EVERY - 1) // DROP_EVERY
    for r in kept:
        assert r["done"] and r["finish"] in ("stop", "length") and r["text"]
        assert 1 <= r["usage"]["completion_tokens"] <= MAX_TOKENS
        assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
        if r["finish"] == "length":
            assert r["usage"]["completion_tokens"] == MAX_TOKENS
    assert all(r["text"] and not r["done"] for r in dropped)

    text = wait_idle(server)
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:num_requests_waiting") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    total = metric(text, "pagoda:kv_cache_total_blocks")
    free = metric(text, "pagoda:kv_cache_free_blocks") + metric(text, "pagoda:kv_cache_cached_blocks")
    assert free == total  # every block is available again (free or a reusable cached prefix)
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == len(dropped)
    finished = (metric(text, "vllm:request_success_total", finished_reason="stop")
                + metric(text, "vllm:request_success_total", finished_reason="length"))
    assert finished == len(kept)
    assert metric(text, "vllm:time_to_first_token_seconds_count") == NUM_STREAMS
    assert metric(text, "vllm:e2e_request_latency_seconds_count") == len(kept)
    print(f"\n64 streams ({len(dropped)} dropped) in {elapsed:.1f} s")

    # The server still answers, with the whole pool available.
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_non_streaming_request_is_aborted_when_the_client_leaves(server):
    before = metric(httpx.get(f"{server}/metrics").text, "vllm:request_success_total", finished_reason="abort")
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    text = wait_idle(server)
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == before + 1
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
