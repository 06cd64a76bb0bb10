"""Cold start: what the first requests after a start get, with an empty and with a warm compile cache.

Issue 14's targets, measured through the server as a user meets it. For each of two starts sharing one new
``PAGODA_HOME`` (the first finds Triton's cache under it empty, the second finds it warm), on the 7B-shape
AWQ model with the engine's default flags:

- start-up: ``app.py serve --no-ui`` until ``/health`` answers 200 with the model loaded;
- time to first token of 10 sequential streaming completions (32-token prompt, 16 tokens out): the first
  must be within 2x of the tenth (the bench's HTTP client is warmed first, on a route that runs no step, so
  its own first-use costs stay out);
- three batches of 128 concurrent requests x (128 prompt + 128 generated tokens), generated tokens over each
  batch's whole wall time: the first must be within 15% of the third.

``--diagnose`` then loads the model once more in this process (offline ``LLM``) with a Triton hook that
lists every kernel specialization compiled (or loaded from disk) after the engine was ready, per phase of
the same workload: the kernels start-up did not warm.
Run on the GPU machine: ``python3 bench/cold_start.py [--diagnose] [--out bench/results/cold_start.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    BenchRun,
    add_common_args,
    at_least,
    at_most,
    engine_cli_flags,
    engine_kwargs,
    info,
    model_for,
)
from bench.serving import free_port, run_load, running_server, server_command
from bench.throughput import exact_params, make_requests, vocab_of

CHATS = 10
BATCHES = 3


async def warm_client(url: str) -> None:
    """Take this bench's own first-use costs (httpx and anyio import their HTTP/1.1 and stream code lazily, on
    the first request of a process) outside the timed requests: one streamed POST to ``/tokenize``, a route
    that runs no engine step, read line by line as the timed requests are."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as client, \
            client.stream("POST", f"{url}/tokenize", json={"prompt": "w5 w6 w7"}) as resp:
        async for _ in resp.aiter_lines():
            pass


def server_workload(run: BenchRun, url: str, label: str, vocab: int) -> None:
    """Ten sequential short requests (TTFT each), then three 128 x (128 + 128) batches (tok/s each)."""
    args = run.args
    rng = random.Random(args.seed)
    asyncio.run(warm_client(url))
    ttfts = []
    for _ in range(CHATS):
        results, _ = asyncio.run(run_load(url, make_requests([(32, 16)], vocab, rng), math.inf, None, 0, None))
        if not results[0].ok:
            raise RuntimeError(f"request failed: {results[0].error}")
        ttfts.append(results[0].ttft)
    run.add(info(f"{label}: TTFT of the first request", ttfts[0] * 1e3, "ms"),
            info(f"{label}: TTFT of the tenth request", ttfts[-1] * 1e3, "ms"),
            info(f"{label}: median TTFT of requests 2-{CHATS}", statistics.median(ttfts[1:]) * 1e3, "ms"),
            at_most(f"{label}: first request's TTFT / tenth's", ttfts[0] / ttfts[-1], "x", 2.0))
    rates = []
    for i in range(BATCHES):
        batch = make_requests([(args.input_len, args.output_len)] * args.concurrent, vocab, rng)
        results, seconds = asyncio.run(run_load(url, batch, math.inf, None, 0, None))
        failed = [r for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
        rates.append(sum(r.output_tokens for r in results) / seconds)
        run.add(info(f"{label}: batch {i + 1} of {args.concurrent} x ({args.input_len} + {args.output_len}), "
                     "generated tokens / wall time", rates[-1], "tok/s"))
    run.add(at_least(f"{label}: first batch's tok/s / third's", rates[0] / rates[-1], "x", 0.85))


def bench_server(run: BenchRun, home: Path) -> None:
    args = run.args
    model_dir = model_for(args, "llama2-7b", "awq")
    flags = engine_cli_flags(engine_kwargs(args))
    for start in ("empty compile cache", "warm compile cache"):
        with running_server(server_command(model_dir, free_port(), flags), args.server_timeout) as (url, ready, _):
            run.add(info(f"start-up to /health 200, {start}", ready, "s"))
            server_workload(run, url, f"7B AWQ, {start}", vocab_of(model_dir))


def bench_diagnose(run: BenchRun) -> None:
    """The same workload offline, listing the Triton specializations first met after start-up."""
    import triton

    from engine import LLM

    args = run.args
    model_dir = model_for(args, "llama2-7b", "awq")
    llm = LLM(str(model_dir), **engine_kwargs(args))
    compiled: Counter = Counter()
    phase = ["?"]

    def hook(*_, **kwargs) -> None:
        compiled[phase[0], kwargs.get("repr", "?")[:240]] += 1

    triton.knobs.runtime.jit_post_compile_hook = hook  # process-wide: this bench's own process only
    rng = random.Random(args.seed)
    vocab = vocab_of(model_dir)
    first_token = []
    for i in range(CHATS):
        phase[0] = f"request {i + 1}"
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": r.prompt} for r in make_requests([(32, 1)], vocab, rng)],
                     exact_params(1))
        first_token.append(time.perf_counter() - start)
    run.add(info("offline: first 1-token request", first_token[0] * 1e3, "ms"),
            info(f"offline: median 1-token request 2-{CHATS}", statistics.median(first_token[1:]) * 1e3, "ms"))
    for i in range(BATCHES):
        phase[0] = f"batch {i + 1}"
        batch = make_requests([(args.input_len, args.output_len)] * args.concurrent, vocab, rng)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": r.prompt} for r in batch], exact_params(args.output_len))
        run.add(info(f"offline batch {i + 1}: generated tokens / wall time",
                     args.concurrent * args.output_len / (time.perf_counter() - start), "tok/s"))
    triton.knobs.runtime.jit_post_compile_hook = None
    for (where, kernel), count in sorted(compiled.items()):
        print(f"[cold_start] compiled after start-up, {where}: {count} x {kernel}", flush=True)
    run.add(at_most("Triton kernels compiled or loaded after start-up (offline, same workload)",
                    sum(compiled.values()), "kernels", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "cold_start")
    parser.add_argument("--concurrent", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--server-timeout", type=float, default=600.0)
    parser.add_argument("--diagnose", action="store_true", help="also list kernels compiled after start-up")
    parser.add_argument("--skip-server", action="store_true", help="only the --diagnose part")
    args = parser.parse_args()
    run = BenchRun("cold_start", args)
    with tempfile.TemporaryDirectory(prefix="pagoda-home-") as home:
        os.environ["PAGODA_HOME"] = home  # a user's first day: Triton's cache under it starts empty
        if not args.skip_server:
            with run.section("server starts"):
                bench_server(run, Path(home))
        if args.diagnose:
            with run.section("diagnose"):
                bench_diagnose(run)
    run.finish()


if __name__ == "__main__":
    main()
