"""Where a batched run's wall time goes, step by step: prefill and decode steps, host phases, graph replays.

A diagnostic (issue 16), not a target check. Runs ``--concurrent`` requests of ``--input-len`` random prompt tokens
and ``--output-len`` generated tokens through ``LLM.generate`` with the engine's default flags (twice: the first
run after a warm-up, then again), and prints for each run: generated tok/s; the wall time of prefill/mixed and of
pure decode steps; the mean decode step at the largest row counts; the host time a step spends in each engine
phase (wrapped with timers, which cost a little themselves); then the device time of a decode graph replay at a
few batch sizes. A decode step much longer than its graph replay means the device waits for the host; with
``--async-scheduling`` (the default) the next step's scheduling and launch run while the device computes.

    python3 bench/step_timeline.py [--shape llama2-7b] [--quant awq] [--no-async-scheduling]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_common_args, model_for, timed
from bench.throughput import load_llm, make_requests, pagoda_generate, vocab_of, warm_up


class StepRecorder:
    """Wraps the engine's step, its scheduler and a few phases with host timers (this process only)."""

    def __init__(self, engine):
        self.plans: list[tuple[int, int]] = []  # (rows, tokens) of each scheduled step
        self.step_seconds: list[float] = []
        self.phase_seconds: collections.Counter = collections.Counter()
        self._wrap(engine.scheduler, "schedule", "schedule", self._record_plan)
        self._wrap(engine, "step", None, self._record_step)
        for owner, name in ((engine.scheduler, "update_after_step"), (engine.scheduler, "fill_ahead"),
                            (engine.runner, "step_inputs"), (engine.runner.sampler, "sample_async"),
                            (engine, "_process_text"), (engine, "_apply_token_stops"), (engine.runner, "launch")):
            self._wrap(owner, name, name)
        if engine.runner.graphs is not None:
            self._wrap(engine.runner.graphs, "run", "graph load + replay launch")

    def _wrap(self, owner, name: str, label: str | None, after=None) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            seconds = time.perf_counter() - start
            if label is not None:
                self.phase_seconds[label] += seconds
            if after is not None:
                after(result, seconds)
            return result

        setattr(owner, name, timed)

    def _record_plan(self, plan, seconds: float) -> None:
        self.plans.append((len(plan.scheduled), sum(item.num_new_tokens for item in plan.scheduled)))

    def _record_step(self, outputs, seconds: float) -> None:
        self.step_seconds.append(seconds)

    def clear(self) -> None:
        self.plans.clear()
        self.step_seconds.clear()
        self.phase_seconds.clear()

    def report(self) -> None:
        """Steps and plans are paired in order (with async scheduling a call finishes the step launched by the
        call before: the pairing is then one off, which steady decoding does not notice)."""
        steps = len(self.step_seconds)
        paired = [(rows, tokens, s) for (rows, tokens), s in zip(self.plans, self.step_seconds) if rows]
        decode = [s for rows, tokens, s in paired if rows == tokens]
        other = [s for rows, tokens, s in paired if rows != tokens]
        print(f"  {steps} steps: {len(other)} prefill/mixed {sum(other):.3f} s, {len(decode)} decode "
              f"{sum(decode):.3f} s ({1e3 * statistics.mean(decode) if decode else 0:.2f} ms a step)")
        by_rows = collections.defaultdict(list)
        for rows, tokens, seconds in paired:
            if rows == tokens:
                by_rows[rows].append(seconds)
        widest = sorted(by_rows)[-4:]
        print("  decode ms by rows: " + ", ".join(f"{r}: {1e3 * statistics.mean(by_rows[r]):.2f}" for r in widest))
        print("  host ms a step: " + ", ".join(f"{name} {1e3 * seconds / max(steps, 1):.3f}"
                                                for name, seconds in self.phase_seconds.most_common()))


def graph_replay_ms(graphs, size: int, reps: int = 20) -> float | None:
    """Device time of one replay of the decode graph for ``size`` rows (CUDA events), or None if none."""
    graph = graphs.graphs.get(("decode", size))
    if graph is None:
        return None
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "step_timeline")
    parser.add_argument("--quant", default="awq", choices=["awq", "fp16"])
    parser.add_argument("--concurrent", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    args = parser.parse_args()
    model_dir = model_for(args, "llama2-7b", args.quant)
    llm = load_llm(args, model_dir, async_scheduling=args.async_scheduling)
    vocab, rng = vocab_of(model_dir), random.Random(args.seed)
    lengths = [(args.input_len, args.output_len)] * args.concurrent
    warm_up(llm, make_requests(lengths, vocab, rng), args.concurrent, vocab, rng)
    recorder = StepRecorder(llm.engine)
    for run in range(2):
        recorder.clear()
        wall, generated = timed(pagoda_generate, args.device, llm, make_requests(lengths, vocab, rng))
        print(f"run {run}: {generated} tokens in {wall:.3f} s = {generated / wall:.0f} generated tok/s "
              f"(async scheduling {'on' if args.async_scheduling else 'off'})")
        recorder.report()
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        for size in (args.concurrent, 64, 1):
            ms = graph_replay_ms(graphs, size)
            if ms is not None:
                print(f"decode graph replay, {size} rows: {ms:.3f} ms")


if __name__ == "__main__":
    main()
