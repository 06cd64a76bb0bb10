"""Online serving: streaming /v1/completions at a request rate or concurrency; TTFT/ITL/TPOT/E2E percentiles.

Like vLLM's benchmark_serving. Starts ``python3 app.py serve --model <folder> --no-ui --port P`` with the
engine flags given here (or uses ``--url`` of a running server), sends ``--num-prompts`` requests with random
token-id prompts whose lengths come from ``--dataset`` (bench/throughput.py's mixes), each asking for exactly
its output length (``max_tokens`` = ``min_tokens``, ``ignore_eos``, greedy), streaming (SSE, with usage).
Arrivals are a Poisson process of ``--request-rate`` per second (``inf``: all at once, seeded), at most
``--max-concurrency`` in flight.

Per request: TTFT = first chunk with text; ITL = gaps between later text chunks (a chunk may carry several
tokens when the client lags, as in vLLM); TPOT = (E2E - TTFT) / (output tokens - 1); output tokens from the
final usage chunk, checked against the requested length (a mismatch counts as a failed request).
The server's CPU per generated token, by thread (its event loop, the rest), is reported too: unlike tok/s it holds
on a busy machine, so serving-path changes compare on the CPU machine (``--shape tiny --device cpu``).
Run on the GPU machine: ``python3 bench/serving.py [--out bench/results/serving.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    ROOT,
    BenchRun,
    add_common_args,
    at_least,
    engine_cli_flags,
    engine_kwargs,
    info,
    model_for,
    percentile,
    shape_label,
)
from bench.throughput import length_mix, make_requests, vocab_of


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # requested
    ok: bool = False
    error: str = ""
    ttft: float = float("nan")
    e2e: float = float("nan")
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else float("nan")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate a child (server or offline run) and reap it; kill it if it ignores that for 30 s."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, interval: float = 0.02) -> float:
    """Poll ``/health`` until it answers 200 with a loaded model; seconds waited. Raises if the server dies"""
    start = time.perf_counter()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before answering /health")
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"server did not answer /health within {timeout:.0f} s")
        try:
            resp = httpx.get(f"{url}/health", timeout=2)
            if resp.status_code == 200 and resp.json().get("model") and not resp.json().get("loading"):
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(interval)


def server_command(model_dir: Path, port: int, engine_flags: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "app.py"), "serve", "--model", str(model_dir), "--no-ui", "--port",
            str(port), "--log-level", "warning", *engine_flags]


@contextmanager
def running_server(cmd: list[str], timeout: float) -> Iterator[tuple[str, float, int]]:
    """Start ``cmd`` (``app.py serve ... --port P``); yield (base URL, seconds to healthy, pid); stop it after."""
    port = cmd[cmd.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PAGODA_API_KEY", None)
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            try:
                wait_healthy(url, proc, timeout)
            except RuntimeError:
                log.seek(0)
                print(log.read().decode(errors="replace")[-4000:], file=sys.stderr)
                raise
            yield url, time.perf_counter() - start, proc.pid
        finally:
            stop_process(proc)


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], output_len: int,
                      model: str | None) -> RequestResult:
    """One streaming completion; fills timings, token count and any error."""
    result = RequestResult(len(prompt), output_len)
    payload = {"prompt": prompt, "max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        payload["model"] = model
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices") or []):
                    if math.isnan(result.ttft):
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        if result.output_tokens != output_len:
            result.error = f"generated {result.output_tokens} tokens, asked for {output_len}"
        else:
            result.ok = True
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(url: str, requests, rate: float, max_concurrency: int | None, seed: int,
                   model: str | None) -> tuple[list[RequestResult], float]:
    """Send every request at Poisson arrival times (rate per second; inf: at once); results, wall seconds."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    connections = min(max_concurrency or len(requests), len(requests)) + 8
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0), limits=limits) as client:
        async def limited(req) -> RequestResult:
            async with limit:
                return await one_request(client, url, req.prompt, req.output_len, model)

        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(rate) and rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(run: BenchRun, label: str, results: list[RequestResult], seconds: float) -> None:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"[serving] {len(failed)} failed, e.g. {failed[0].error}", file=sys.stderr)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    run.add(at_least(f"{label}: requests completed with exactly their output length", len(ok), "requests",
                     len(results)),
            info(f"{label}: duration", seconds, "s"),
            info(f"{label}: request throughput", len(ok) / seconds, "req/s"),
            info(f"{label}: output token throughput", out_tokens / seconds, "tok/s"),
            info(f"{label}: total token throughput", (in_tokens + out_tokens) / seconds, "tok/s"))
    series = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if not math.isnan(r.tpot)],
              "ITL": [gap for r in ok for gap in r.itl], "E2E latency": [r.e2e for r in ok]}
    for name, values in series.items():
        mean = sum(values) / len(values) if values else float("nan")
        run.add(info(f"{label}: mean {name}", mean * 1e3, "ms"))
        for q in (50, 90, 99):
            run.add(info(f"{label}: p{q} {name}", percentile(values, q) * 1e3, "ms"))


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of process ``pid``, by thread id (the main thread's is the pid)."""
    return {thread.id: thread.user_time + thread.system_time for thread in psutil.Process(pid).threads()}


def server_cpu_rows(label: str, pid: int, before: dict[int, float], tokens: int) -> list[dict]:
    """The server's CPU per generated token over the timed run: its main thread (the event loop that streams
    every token) and the rest (the engine loop thread, torch's threads). Unlike tok/s, these hold on a busy
    machine, so they compare serving-path changes on the CPU machine too (BENCHMARKS.md, serving path)."""
    after = thread_cpu_seconds(pid)
    spent = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    per_token = 1e6 / max(tokens, 1)
    return [info(f"{label}: server event-loop thread CPU per generated token", spent.pop(pid, 0.0) * per_token,
                 "us"),
            info(f"{label}: server's other threads' CPU per generated token", sum(spent.values()) * per_token,
                 "us")]


def bench_serving(run: BenchRun, url: str, model_label: str, vocab: int, model: str | None,
                  server_pid: int | None = None) -> None:
    args = run.args
    rng = random.Random(args.seed)
    requests = make_requests(length_mix(args, args.num_prompts, rng), vocab, rng)
    warm_lengths = [(len(r.prompt), min(r.output_len, 8)) for r in requests[:args.warmup_requests]]
    warm = make_requests(warm_lengths, vocab, rng)
    if warm:
        asyncio.run(run_load(url, warm, math.inf, None, args.seed, model))  # compile/autotune, fresh prompts
    cpu_before = thread_cpu_seconds(server_pid) if server_pid else {}
    results, seconds = asyncio.run(run_load(url, requests, args.request_rate, args.max_concurrency, args.seed,
                                            model))
    rate = "inf" if not math.isfinite(args.request_rate) else f"{args.request_rate:g}"
    conc = f", max concurrency {args.max_concurrency}" if args.max_concurrency else ""
    label = f"{model_label}, {len(requests)} {args.dataset} requests at rate {rate}/s{conc}"
    summarize(run, label, results, seconds)
    if server_pid:
        run.add(*server_cpu_rows(label, server_pid, cpu_before, sum(r.output_tokens for r in results if r.ok)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "serving")
    parser.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    parser.add_argument("--served-model", default=None, help="'model' field to send (default: loaded)")
    parser.add_argument("--vocab-size", type=int, default=None, help="with --url: token ids stay below this")
    parser.add_argument("--quant", default="awq", choices=["awq", "fp16"], help="model to start (7B shape)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=16.0, help="requests/s (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random", "fixed"])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--prompt-cap", type=int, default=1024)
    parser.add_argument("--output-cap", type=int, default=512)
    parser.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --url: the server's pid, to report its CPU per generated token")
    args = parser.parse_args()
    run = BenchRun("serving", args)
    with run.section("serving"):
        if args.url:
            wait_healthy(args.url.rstrip("/"), None, args.server_timeout)
            url = args.url.rstrip("/")
            bench_serving(run, url, "server at --url", args.vocab_size or 32000, args.served_model,
                          args.server_pid)
        else:
            model_dir = model_for(args, "llama2-7b", args.quant)
            flags = engine_cli_flags(engine_kwargs(args))
            cmd = server_command(model_dir, free_port(), flags)
            with running_server(cmd, args.server_timeout) as (url, ready, pid):
                run.add(info("server start to /health 200", ready, "s"))
                label = f"{shape_label(args, 'llama2-7b')} {'AWQ' if args.quant == 'awq' else 'fp16'}"
                bench_serving(run, url, label, vocab_of(model_dir), args.served_model, pid)
    run.finish()


if __name__ == "__main__":
    main()
