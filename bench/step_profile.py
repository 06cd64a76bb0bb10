"""Where one engine step's time goes on the GPU: host launch time vs device time of a forward, and a profile.

A diagnostic, not a target check: ``python3 bench/step_profile.py --model <folder> [--batch 1 32 128]``.
For each batch size it times (a) an eager forward's host time (Python + launches, no sync) against its device
time (CUDA events), (b) a graph replay's device time, and (c) whole engine steps with graphs, then prints the
top host functions of the engine loop under cProfile, so launch overhead and Python per step are measured
rather than guessed. ``--kernels`` adds a per-kernel device-time table (torch.profiler / CUPTI) of graph
replays and of eager forwards at batch 1: how much of a replay is kernel time and how much is gaps between
kernels, and which kernels dominate.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams
from engine.cuda_graph import StepInputs


def decode_inputs(runner, batch: int, context: int) -> StepInputs:
    """Synthetic decode inputs: ``batch`` sequences of ``context`` tokens over distinct blocks."""
    bs = runner.layout.block_size
    blocks = -(-context // bs)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks) % runner.layout.num_blocks
    pos = np.full(batch, context - 1, dtype=np.int64)
    slots = tables[:, -1].astype(np.int64) * bs + (context - 1) % bs
    return StepInputs(np.full(batch, 5, dtype=np.int64), pos, slots, np.arange(batch + 1, dtype=np.int32),
                      np.full(batch, context, dtype=np.int32), tables, np.arange(batch, dtype=np.int64), True)


def time_forward(runner, inputs: StepInputs, repeats: int = 20) -> tuple[float, float, float]:
    """(eager host ms, eager device ms, graph device ms) medians for one decode forward."""
    graphs = runner.graphs
    shape = graphs.shape_for(inputs)
    batch = inputs.to_batch(runner.device)
    host, dev, graph = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start_evt.record()
        runner.model.forward(batch)
        end_evt.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        dev.append(start_evt.elapsed_time(end_evt))
        start_evt.record()
        graphs.run(inputs, shape)
        end_evt.record()
        torch.cuda.synchronize()
        graph.append(start_evt.elapsed_time(end_evt))
    return statistics.median(host), statistics.median(dev), statistics.median(graph)


def profile_eager_forward(runner, inputs: StepInputs, repeats: int = 10) -> None:
    """Host profile of eager forwards (where Python and launch time goes when no graph replays)."""
    batch = inputs.to_batch(runner.device)
    runner.model.forward(batch)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        runner.model.forward(batch)
    prof.disable()
    torch.cuda.synchronize()
    print(f"--- eager forward x{repeats}, batch {inputs.num_seqs}: host functions by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def kernel_table(runner, inputs: StepInputs, graph: bool, repeats: int = 20) -> None:
    """Device time per forward by kernel name, over ``repeats`` graph replays (or eager forwards)."""
    from torch.profiler import ProfilerActivity, profile

    shape = runner.graphs.shape_for(inputs)
    batch = inputs.to_batch(runner.device)

    def once():
        if graph:
            runner.graphs.run(inputs, shape)
        else:
            runner.model.forward(batch)

    once()
    torch.cuda.synchronize()
    start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start_evt.record()
        for _ in range(repeats):
            once()
        end_evt.record()
        torch.cuda.synchronize()
    wall = start_evt.elapsed_time(end_evt) * 1e3 / repeats  # us per forward
    rows = []
    for avg in prof.key_averages():
        total = getattr(avg, "device_time_total", None) or getattr(avg, "cuda_time_total", 0)
        if total and avg.count:
            rows.append((total / repeats, avg.count / repeats, avg.key))
    rows.sort(reverse=True)
    busy = sum(r[0] for r in rows)
    kind = "graph replay" if graph else "eager forward"
    print(f"--- kernels per {kind}, batch {inputs.num_seqs}: {sum(r[1] for r in rows):.0f} launches, "
          f"{busy:.0f} us kernel time of {wall:.0f} us elapsed ({100 * busy / max(wall, 1e-9):.0f}% busy)")
    for per, count, name in rows[:25]:
        print(f"  {per:8.1f} us  {count:5.1f}x  {name[:110]}")


def engine_steps(llm, batch: int, steps: int, profile: bool) -> float:
    """Median ms per engine step while ``batch`` requests decode; optionally prints a host profile."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        llm.engine.add_request(f"p{batch}-{i}", prompt_token_ids=[5 + i % 100] * 16, params=params)
    llm.engine.step()  # prefill
    times = []
    prof = cProfile.Profile() if profile else None
    while llm.engine.has_unfinished_requests():
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        llm.engine.step()
        if prof:
            prof.disable()
        times.append((time.perf_counter() - t0) * 1e3)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--gpu-memory-limit", default="40GiB")
    parser.add_argument("--kernels", action="store_true", help="per-kernel device-time tables at batch 1")
    parser.add_argument("--no-fused-decode", action="store_true", help="one-sequence decode through the unfused layer")
    args = parser.parse_args()
    llm = LLM(args.model, dtype="float16", device="cuda", gpu_memory_limit=args.gpu_memory_limit,
              max_num_seqs=max(args.batch), fused_decode=not args.no_fused_decode)
    runner = llm.engine.runner
    print(f"graphs: {len(runner.graphs.graphs)} shapes, captured in {runner.graphs.capture_seconds:.2f} s,"
          f" pool {runner.cuda_graph_pool_bytes / 2**20:.0f} MiB")
    profile_eager_forward(runner, decode_inputs(runner, 1, args.context))
    if args.kernels:
        for graph in (True, False):
            kernel_table(runner, decode_inputs(runner, 1, args.context), graph)
    for batch in args.batch:
        host, dev, graph = time_forward(runner, decode_inputs(runner, batch, args.context))
        step = engine_steps(llm, batch, 32, profile=batch == max(args.batch))
        print(f"[step-profile] batch {batch}: eager forward host {host:.2f} ms / device {dev:.2f} ms; "
              f"graph replay {graph:.2f} ms; engine step (graphs, sampling, host) {step:.2f} ms "
              f"-> {batch / step * 1e3:.0f} tok/s")


if __name__ == "__main__":
    main()
