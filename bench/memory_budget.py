"""Issue 16: does the process stay within ``--gpu-memory-limit`` as the driver counts it, start-up and load?

The engine starts as ``app.py serve`` starts it (``AsyncEngine``: built on one thread, warmed up and stepped on
its loop thread, whose cuBLAS handle is its own), with the engine defaults but the budget. A sampler thread
reads the device's used memory (``cudaMemGetInfo``) every millisecond; ``nvidia-smi``'s figure for this process
calibrates it once the engine is up (the card's own reservations and other processes are the difference) and
checks it at the end. Then ``--requests`` concurrent requests of 16..``--input-len`` random prompt tokens and
16..``--output-len`` generated tokens (uniform, top-p sampling) run through the loop thread: at the default
``max_num_seqs`` (256) and more tokens than the KV pool holds, every decode row fills, requests are preempted,
and eager steps of many sizes run.

    python3 bench/memory_budget.py --shape llama3-8b --gpu-memory-limit 24GiB --out $OUT/memory_budget.json

Rows: the driver-counted peak of start-up and of the load over the budget (target <= 1.0), nvidia-smi's figure
at the end, where the budget went (engine/model_runner.py ``MemoryProfile``), and torch's allocated and
reserved peaks during the load with the allocator's retries (each one a return of its cached blocks to the
driver at the engine's limit, engine/memory.py ``TorchPoolLimit``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import BenchRun, add_common_args, at_most, engine_kwargs, info, model_for
from engine.config import EngineArgs
from engine.memory import device_bytes_outside_torch
from engine.request import SamplingParams

MIB = 2**20


class UsedMemorySampler:
    """Reads the device's used bytes (total - free) every ``period`` seconds on a thread; keeps the maximum
    since the last ``take_peak``."""

    def __init__(self, device: torch.device, period: float = 0.001):
        self.device, self.period = device, period
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self.used()
            with self._lock:
                self._peak = max(self._peak, used)
            time.sleep(self.period)

    def take_peak(self) -> int:
        """The highest reading since the last call (or the start), then start over."""
        with self._lock:
            peak, self._peak = max(self._peak, self.used()), 0
        return peak


def smi_process_bytes(pid: int) -> int | None:
    """nvidia-smi's used memory of process ``pid`` (bytes), or None where nvidia-smi does not list it."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) * MIB
    return None


async def run_load(engine, requests: list[tuple[list[int], int]]) -> int:
    """All (prompt, output length) requests at once through the engine's loop thread, sampled with top-p
    (the sampler's largest temporaries); returns the generated tokens."""

    async def one(prompt: list[int], output_len: int) -> int:
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=output_len, ignore_eos=True)
        tokens = 0
        async for output in engine.generate(prompt_token_ids=prompt, params=params):
            tokens = len(output.outputs[0].token_ids)
        return tokens

    return sum(await asyncio.gather(*(one(p, n) for p, n in requests)))


def bench_budget(run: BenchRun) -> None:
    from engine.async_engine import AsyncEngine

    args = run.args
    device = torch.device(args.device)
    model_dir = model_for(args, "llama3-8b", args.quant)
    label = f"{args.shape or 'llama3-8b'} {args.quant.upper()} under --gpu-memory-limit {args.gpu_memory_limit}"
    torch.cuda.init()
    sampler = UsedMemorySampler(device)
    sampler.start()
    try:
        started = time.perf_counter()
        engine = AsyncEngine(EngineArgs(model=str(model_dir), **engine_kwargs(args)))
        start_up_seconds = time.perf_counter() - started
        try:
            torch.cuda.synchronize(device)
            start_up_peak = sampler.take_peak()
            smi_now, used_now = smi_process_bytes(os.getpid()), sampler.used()
            offset = used_now - smi_now if smi_now is not None else 0  # the card's and other processes' bytes
            runner = engine.llm_engine.runner
            profile = runner.memory_profile
            rng = random.Random(args.seed)
            vocab = runner.config.vocab_size
            requests = [([rng.randrange(3, vocab) for _ in range(rng.randint(16, args.input_len))],
                         rng.randint(16, args.output_len)) for _ in range(args.requests)]
            retries_before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            torch.cuda.reset_peak_memory_stats(device)
            load_started = time.perf_counter()
            generated = asyncio.run(run_load(engine, requests))
            load_seconds = time.perf_counter() - load_started
            torch.cuda.synchronize(device)
            load_peak = sampler.take_peak()
            smi_end = smi_process_bytes(os.getpid())
            allocator = torch.cuda.memory_stats(device)
            outside_end = device_bytes_outside_torch(device)
            stats = engine.stats()
        finally:
            engine.shutdown()
    finally:
        sampler.stop()
    budget, gib = profile.budget, 2**30
    run.add(at_most(f"{label}: driver-counted peak during start-up / budget", (start_up_peak - offset) / budget,
                    "fraction", 1.0),
            at_most(f"{label}: driver-counted peak during the load / budget", (load_peak - offset) / budget,
                    "fraction", 1.0),
            info(f"{label}: nvidia-smi's figure for the process after the load / budget",
                 smi_end / budget if smi_end is not None else None, "fraction"),
            info(f"{label}: budget", budget / gib, "GiB"),
            info(f"{label}: weights", profile.weights / gib, "GiB"),
            info(f"{label}: activation peak (profiled forward)", profile.activation_peak / gib, "GiB"),
            info(f"{label}: torch's start-up peak without KV (trial start-up)", profile.start_up_peak / gib, "GiB"),
            info(f"{label}: outside torch (CUDA context, kernels, graph executables)", profile.outside_torch / gib,
                 "GiB"),
            *(info(f"{label}: torch's reserved peak in the trial's {stage} stage", peak / gib, "GiB")
              for stage, peak in runner.trial.stage_peaks.items()),
            info(f"{label}: torch's pool limit while serving (the budget)", profile.torch_limit / gib, "GiB"),
            info(f"{label}: KV pool", profile.kv_cache / gib, "GiB"),
            info(f"{label}: KV capacity", runner.layout.capacity_tokens, "tokens"),
            info(f"{label}: start-up (AsyncEngine built and warmed up)", start_up_seconds, "s"),
            info(f"{label}: {args.requests} requests x (16..{args.input_len} + 16..{args.output_len}) generated tokens",
                 generated, "tokens"),
            info(f"{label}: load wall time", load_seconds, "s"),
            info(f"{label}: preemptions", stats.get("num_preemptions", 0), "requests"),
            info(f"{label}: torch's allocated peak during the load", allocator["allocated_bytes.all.peak"] / gib,
                 "GiB"),
            info(f"{label}: torch's reserved peak during the load", allocator["reserved_bytes.all.peak"] / gib,
                 "GiB"),
            info(f"{label}: outside torch after the load", outside_end / gib, "GiB"),
            info(f"{label}: allocator retries during the load (cached blocks freed at the limit)",
                 allocator.get("num_alloc_retries", 0) - retries_before, "count"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "memory_budget")
    parser.add_argument("--quant", default="awq", choices=["awq", "fp16"])
    parser.add_argument("--requests", type=int, default=768)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=512)
    parser.set_defaults(gpu_memory_limit="24GiB")
    args = parser.parse_args()
    if torch.device(args.device).type != "cuda":
        sys.exit("memory_budget measures the driver's count of a GPU process: run it on a CUDA device")
    run = BenchRun("memory_budget", args)
    with run.section("budget"):
        bench_budget(run)
    run.finish()


if __name__ == "__main__":
    main()
