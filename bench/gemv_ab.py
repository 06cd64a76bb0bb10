"""A/B of the one-row GEMV against an earlier version of its module, in one process on one GPU.

Why: batch-1 decode figures move 5-15% between machines of the same kind (BENCHMARKS.md), more than most kernel
changes, so a change is judged against its predecessor in the same run. The baseline is a copy of
``kernels/triton/w4a16_gemv.py`` from an earlier commit, made where git is (the GPU machine gets no .git):

    git show HEAD~1:kernels/triton/w4a16_gemv.py > scratch/old_w4a16_gemv.py
    python3 bench/gemv_ab.py --baseline-file scratch/old_w4a16_gemv.py --out bench/results/kernels_gemv_ab.json

A change to the shared epilogue (``gemv_epilogue.py``) needs the earlier package whole: ``bash
bench/baseline_kernels.sh <commit>`` writes it as .devcache/baseline_kernels, then ``--baseline-package .devcache``.

Each case is a launch of the fused decode layer (SmolLM2-135M, Llama-2-7B and Llama-3-8B shapes, default
plans) with the arguments the engine passes to that version (the prescaled norm input where it has one),
timed as CUDA-graph replays over rotating weights, baseline and current alternately, twice each.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernels import bench_graph, random_int4, sets_for
from kernels.triton import w4a16_gemv as current

DEV = "cuda"
LAYERS = {  # shape: (hidden, intermediate, q width, kv width, head size, group size)
    "SmolLM2": (576, 1536, 576, 192, 64, 32),
    "7B": (4096, 11008, 4096, 4096, 128, 128),
    "8B": (4096, 14336, 4096, 1024, 128, 128),
}


def load_baseline(path: Path):
    spec = importlib.util.spec_from_file_location("baseline_w4a16_gemv", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def rope_args(q_size: int, kv_size: int, head_dim: int) -> dict:
    cache = (64, 16, kv_size // head_dim, head_dim)
    return {"positions": torch.tensor([7], device=DEV), "slot_mapping": torch.tensor([100], device=DEV),
            "cos_sin_cache": torch.rand(4096, head_dim, device=DEV),
            "k_cache": torch.zeros(cache, dtype=torch.float16, device=DEV),
            "v_cache": torch.zeros(cache, dtype=torch.float16, device=DEV),
            "q_size": q_size, "kv_size": kv_size, "head_dim": head_dim}


def layer_launches(shape: str):
    """(label, K, N, group, fused keyword arguments, what a version with ``normed`` / ``next_norm`` adds) of the
    four GEMV launches of a fused decode layer."""
    hidden, inter, q_size, kv_size, head_dim, group = LAYERS[shape]
    norm = torch.rand(hidden, dtype=torch.float16, device=DEV) + 0.5
    residual = torch.randn(1, hidden, dtype=torch.float16, device=DEV)
    normed = torch.empty_like(residual)  # the next norm's x * weight, as o and down write it
    next_norm = {"next_norm": (norm, normed)}
    yield f"{shape} qkv norm+rope", hidden, q_size + 2 * kv_size, group, {
        "norm_weight": norm, "eps": 1e-5, "rope": rope_args(q_size, kv_size, head_dim)}, {"normed": normed}
    yield f"{shape} o residual", q_size, hidden, group, {"residual": residual}, next_norm
    yield f"{shape} gate/up norm+silu", hidden, 2 * inter, group, {"norm_weight": norm, "eps": 1e-5, "silu": True}, {
        "normed": normed}
    yield f"{shape} down residual", inter, hidden, group, {"residual": residual}, next_norm


def engine_kwargs(module, fused: dict, prescaled: dict) -> dict:
    """A launch's arguments as the engine passes them to this version: with the prescaled norm input where the
    version has it (its ``w4a16_gemv`` takes ``normed`` and ``next_norm``)."""
    if "normed" in inspect.signature(module.w4a16_gemv).parameters:
        return {**fused, **prescaled}
    return fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    baseline = parser.add_mutually_exclusive_group(required=True)
    baseline.add_argument("--baseline-file", type=Path, help="an earlier w4a16_gemv.py (with the tree's epilogue)")
    baseline.add_argument("--baseline-package", type=Path,
                          help="the folder holding baseline_kernels/ (bench/baseline_kernels.sh): an earlier GEMV "
                               "with its own epilogue")
    parser.add_argument("--out", default="bench/results/kernels_gemv_ab.json")
    parser.add_argument("--k-step", type=int, default=None,
                        help="also time the current kernel's o and down launches with K steps of this many rows")
    args = parser.parse_args()
    if args.baseline_package:
        sys.path.insert(0, str(args.baseline_package.resolve()))
        baseline = importlib.import_module("baseline_kernels.triton.w4a16_gemv")
    else:
        baseline = load_baseline(args.baseline_file)
    versions = {"baseline": (baseline, None), "current": (current, None)}
    if args.k_step:
        versions[f"current_k{args.k_step}"] = (current, args.k_step)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in LAYERS:
        for label, k, n, group, fused, prescaled in layer_launches(shape):
            weights = [random_int4(k, n, group) for _ in range(sets_for(k * n // 2))]
            x = torch.randn(1, k, dtype=torch.float16, device=DEV)
            times = {name: [] for name in versions}
            for _ in range(2):
                for name, (module, k_step) in versions.items():
                    kwargs = engine_kwargs(module, fused, prescaled)
                    if k_step and "norm_weight" not in fused:  # o and down: the default plan but for the K
                        # step (a norm launch's squares and prescaled x spill ~600 B at 128 rows under the cap;
                        # small matrices' one-step plans stay as they are)
                        kwargs["plan"] = current.gemv_plan(n, k, group, sms, block_k=k_step)
                    calls = [partial(module.w4a16_gemv, x, *w, group, **kwargs) for w in weights]
                    times[name].append(round(bench_graph(calls) * 1e3, 2))
            rows.append({"case": label, **{f"{name}_us": t for name, t in times.items()}})
            print(f"{label:<28} " + ", ".join(f"{name} {t} us" for name, t in times.items()), flush=True)
            del weights
            torch.cuda.empty_cache()
    doc = {"card": torch.cuda.get_device_name(), "command": "python3 bench/gemv_ab.py " + " ".join(sys.argv[1:]),
           "cases": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
