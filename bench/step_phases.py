"""Where an engine step's host time goes, plain against grammar-constrained (issue 17's per-token cost).

Wraps the step's phases with host timers (the wall time of each call, summed, per step) and generates the same
prompts plain and with a JSON-schema constraint: a phase that grows by about the forward's time is where the
host waits for the device instead of overlapping it (``PendingSample.result`` is where it should wait).
``--sync-debug`` makes torch warn, with a stack, at every call that synchronizes with the device.
Run on the GPU machine: ``python3 bench/step_phases.py --tokenizer .devcache/smollm2-tokenizer``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import DEFAULT_MODELS_DIR, default_device
from bench.structured_cost import NESTED_SCHEMA, constrained_params, twin_params, with_tokenizer
from bench.throughput import make_requests, vocab_of


class PhaseTimers:
    """Host seconds and calls per wrapped function; ``wrap`` replaces the attribute for this process."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}".replace("engine.", "")

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(timers: PhaseTimers) -> None:
    import engine.structured_output as structured
    from engine import llm_engine, model_runner, sampler
    from kernels import ops

    for owner, name in [(llm_engine.LLMEngine, "step"), (llm_engine.LLMEngine, "_grammar_step"),
                        (llm_engine.LLMEngine, "_process_text"), (model_runner.ModelRunner, "launch"),
                        (structured.StructuredOutputManager, "step_job"),
                        (model_runner.PendingStep, "result"), (sampler.Sampler, "sample_async"),
                        (sampler.PendingSample, "result"),
                        (structured.GrammarStep, "finish"), (llm_engine.LLMEngine, "_end_completed_grammars"),
                        (sampler, "apply_token_masks"), (sampler, "apply_logits_processors"), (sampler, "to_device"),
                        (ops.Backend, "masked_logits")]:
        timers.wrap(owner, name)


def report(timers: PhaseTimers, label: str, wall: float) -> None:
    steps = max(timers.calls["LLMEngine.step"], 1)
    print(f"{label}: {wall * 1e3:.1f} ms, {steps} steps, {wall / steps * 1e6:.0f} us a step", flush=True)
    for key in sorted(timers.seconds):
        print(f"    {key:<40} {timers.seconds[key] / steps * 1e6:9.1f} us a step ({timers.calls[key]} calls)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="folder with a BPE tokenizer.json (vocabulary <= 49,152)")
    parser.add_argument("--models-dir", default=DEFAULT_MODELS_DIR)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--sync-debug", action="store_true", help="torch warns at every synchronizing call")
    args = parser.parse_args()
    from bench.random_model import BuildSpec, build_model
    from engine import LLM

    timers = PhaseTimers()
    instrument(timers)
    model_dir = with_tokenizer(build_model(Path(args.models_dir), BuildSpec("smollm2-135m", "awq"), args.device),
                               Path(args.tokenizer))
    kwargs = {"gpu_memory_limit": "24GiB"} if args.device == "cuda" else {}
    llm = LLM(str(model_dir), dtype="float16", device=args.device, **kwargs)
    rng = random.Random(0)
    vocab = min(vocab_of(model_dir), 49152)
    params = constrained_params(NESTED_SCHEMA, args.output_len)
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [{"prompt_token_ids": r.prompt} for r in make_requests([(32, args.output_len)] * batch, vocab, rng)]
        llm.generate(prompts, params)  # warm
        for label in ("constrained", "plain twin"):
            timers.clear()
            if label == "constrained":
                if args.sync_debug and args.device == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                lengths = [len(o.outputs[0].token_ids) for o in outputs]
                if args.device == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
            else:
                start = time.perf_counter()
                llm.generate(prompts, twin_params(lengths))
            report(timers, f"batch {batch} {label}", time.perf_counter() - start)
    print(json.dumps({"lengths_batch_last": lengths[:8]}))


if __name__ == "__main__":
    main()
