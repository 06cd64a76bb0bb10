"""W4A16 at M = 1 (issue 15): our GEMV against copy bandwidth, the older paths, GemLite and tinygemm, one run.

Run on the GPU machine: ``python3 bench/gemv.py [--out kernels_gemv.json] [--sweep]`` (GemLite is imported
from ``.peers``, see ../shared/peers/README.md). Each op is timed as CUDA-graph replays over enough input sets
to exceed the L2 (bench/kernels.py's ``bench_graph``), so weights come from HBM and launch overhead is the
in-graph one the engine pays. Bytes counted: packed weights, scales and zeros (fp16), x and y.
``--sweep`` times tile / split / warp variants of our kernel per shape (the basis of ``gemv_plan``).
``--dense`` times the fp16 GEMV (kernels/triton/dense_gemv.py) against cuBLAS's one-row matmul on the fp16
7B layer, the LM heads and SmolLM2, with its plan variants (the basis of ``dense_gemv_plan``), into
``--out`` (default kernels_gemv_dense.json). ``--x16`` times the fused layer's int4 launches with both dots at
the rule's grid and others (``--x16-warps``); with ``--tuned-out`` the grids that beat the rule go into a copy
of kernels/triton/tuned/w4a16_gemv.json for this card (``bench/single_stream.sh grids``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import traceback
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernels import TUNED_MARGIN, bench_graph, copy_bandwidth, random_int4, sets_for, write_tuned
from kernels.reference import dequantize_int4
from kernels.triton import w4a16 as w4a16_mod
from kernels.triton.common import next_pow2, num_sms
from kernels.triton.dense_gemv import DenseGemvPlan, dense_gemv, dense_gemv_plan
from kernels.triton.w4a16_gemv import LARGE_MATRIX_REGISTERS, SMALL_MATRIX, GemvPlan, gemv_plan, w4a16_gemv

DEV = "cuda"
SHAPES = {  # K x N, group size; the targets are on the Llama-3-8B shapes
    "8B qkv 4096x6144": (4096, 6144, 128),
    "8B o 4096x4096": (4096, 4096, 128),
    "8B gate/up 4096x28672": (4096, 28672, 128),
    "8B gate or up 4096x14336": (4096, 14336, 128),
    "8B down 14336x4096": (14336, 4096, 128),
    "7B qkv 4096x12288": (4096, 12288, 128),
    "7B gate/up 4096x22016": (4096, 22016, 128),
    "7B down 11008x4096": (11008, 4096, 128),
    "SmolLM2 qkv 576x960 g32": (576, 960, 32),
    "SmolLM2 gate/up 576x3072 g32": (576, 3072, 32),
    "SmolLM2 down 1536x576 g32": (1536, 576, 32),
    "SmolLM2 o 576x576 g32": (576, 576, 32),
    "0.5B gate/up 896x9728": (896, 9728, 128),  # Qwen2.5-0.5B
    "1B o 2048x2048": (2048, 2048, 128),  # Llama-3.2-1B
    "1B gate/up 2048x16384": (2048, 16384, 128),
}
TARGETS = {  # shape -> (fraction of copy bandwidth, x GemLite, x tinygemm)
    "8B gate or up 4096x14336": (0.70, 1.3, 1.2),
    "8B down 14336x4096": (0.70, 1.3, 1.2),
    "8B gate/up 4096x28672": (0.70, 1.3, 1.2),
    "8B o 4096x4096": (0.50, 1.3, 1.2),
}


def weight_bytes(k: int, n: int, group: int) -> int:
    return k * n // 2 + 2 * (k // group) * n * 2 + 2 * k + 2 * n


def time_ours(x, weights, group, plan=None) -> float:
    return bench_graph([partial(w4a16_gemv, x, *w, group, plan=plan) for w in weights])


def time_previous(x, weights, group) -> float:
    return bench_graph([partial(w4a16_mod.w4a16_matmul, x, *w, group) for w in weights])


def time_gemlite(x, k, n, group, count) -> float:
    sys.path.insert(0, str(ROOT / ".peers"))
    from gemlite.core import DType, GemLiteLinear

    GemLiteLinear.load_config(str(ROOT / ".peers/gemlite/configs/h100.json"), print_error=False)
    layers = []
    for _ in range(count):
        layer = GemLiteLinear(W_nbits=4, group_size=group, in_features=k, out_features=n,
                              input_dtype=DType.FP16, output_dtype=DType.FP16)
        w_q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=DEV)
        scales = (torch.rand(n, k // group, device=DEV) * 0.01 + 0.001).half()
        zeros = torch.randint(5, 11, (n, k // group), device=DEV).half()
        layer.pack(w_q, scales, zeros)
        layers.append(layer)
    return bench_graph([partial(layer, x) for layer in layers])


def time_tinygemm(x, k, n, group, count) -> float:
    xb = x.bfloat16()
    calls = []
    for _ in range(count):
        w = torch.randint(0, 16, (n, k), dtype=torch.int32, device=DEV)
        packed = torch._convert_weight_to_int4pack((w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8), 8)
        sz = torch.rand(k // group, n, 2, device=DEV).bfloat16()
        calls.append(partial(torch._weight_int4pack_mm, xb, packed, group, sz))
    return bench_graph(calls)


def time_fp16(x, k, n) -> float:
    dense = [torch.randn(n, k, dtype=torch.float16, device=DEV) for _ in range(sets_for(2 * k * n))]
    return bench_graph([partial(torch.nn.functional.linear, x, w) for w in dense])


def time_all(x, weights, k: int, n: int, group: int, peer_sets: int) -> dict:
    """Microseconds per call of ours, the previous path, the peers and fp16 cuBLAS (None where one fails)."""
    timers = {
        "ours": partial(time_ours, x, weights, group),
        "previous": partial(time_previous, x, weights, group),
        "gemlite": partial(time_gemlite, x, k, n, group, peer_sets),
        "tinygemm": partial(time_tinygemm, x, k, n, group, peer_sets),
        "fp16": partial(time_fp16, x, k, n),
    }
    times = {}
    for name, timer in timers.items():
        try:
            times[f"{name}_us"] = round(timer() * 1e3, 2)
        except Exception:  # noqa: BLE001 (a peer that fails to run is reported, the rest go on)
            traceback.print_exc()
            times[f"{name}_us"] = None
    return times


def sweep_plans(k: int, n: int, group: int, sms: int):
    """Tile, warps, K step and programs per SM (the split is the most that keeps the grid within ``per_sm``
    programs an SM), one-warp tiles of a large matrix with and without the engine's register cap, and one K
    step a program: the basis of ``gemv_plan``."""
    small = k * n <= SMALL_MATRIX
    tiles = ((32, 1), (64, 2), (128, 1), (128, 4)) if small else ((32, 1), (128, 1), (256, 2))
    block_ks = (32, 64, 128) if small else (64, 128)
    per_sms = (4, 8) if small else (8, 16, 24)
    seen = set()
    for (block_n, warps), block_k, per_sm in itertools.product(tiles, block_ks, per_sms):
        if block_k > k or k % block_k or n % block_n:
            continue
        steps = k // block_k
        for split in (max(1, min(steps, per_sm * sms // -(-n // block_n), 64)), min(steps, 64)):
            caps = (None,) if small or warps > 1 else (None, LARGE_MATRIX_REGISTERS)  # the engine's plans are capped
            for cap in caps:
                plan = GemvPlan(block_n, block_k, split, warps, max_registers=cap)
                if plan not in seen:
                    seen.add(plan)
                    yield plan
    if small:  # each program's whole split loaded at once; one split finishes without partials
        for (block_n, warps), split in itertools.product(((32, 2), (32, 4), (64, 4), (64, 8), (128, 4)), (1, 2, 3)):
            if n % block_n == 0:
                yield GemvPlan(block_n, 0, split, warps, one_step=True)


def time_fusions() -> None:
    """Microseconds of each fused variant on the Llama-2-7B layer shapes (where a fused decode layer's time goes)."""
    hidden, heads, head_dim = 4096, 32, 128
    cos_sin = torch.rand(4096, head_dim, device=DEV)
    k_cache = torch.zeros(64, 16, heads, head_dim, dtype=torch.float16, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    rope = {"positions": torch.tensor([7], device=DEV), "slot_mapping": torch.tensor([100], device=DEV),
            "cos_sin_cache": cos_sin, "k_cache": k_cache, "v_cache": v_cache, "q_size": hidden, "kv_size": hidden,
            "head_dim": head_dim}
    norm = torch.rand(hidden, dtype=torch.float16, device=DEV) + 0.5
    residual = torch.randn(1, hidden, dtype=torch.float16, device=DEV)
    normed = torch.empty_like(residual)  # x * norm weight, as the fused layer's o and down write it
    prescaled = {"norm_weight": norm, "normed": normed}
    cases = {
        "qkv 4096x12288": (4096, 12288, {"": {}, "norm": {"norm_weight": norm}, "rope": {"rope": rope},
                                          "norm+rope": {"norm_weight": norm, "rope": rope},
                                          "prescaled norm+rope": {**prescaled, "rope": rope}}),
        "gate/up 4096x22016": (4096, 22016, {"": {}, "norm": {"norm_weight": norm}, "silu": {"silu": True},
                                              "norm+silu": {"norm_weight": norm, "silu": True},
                                              "prescaled norm+silu": {**prescaled, "silu": True}}),
        "o 4096x4096": (4096, 4096, {"": {}, "residual": {"residual": residual},
                                      "residual+next norm": {"residual": residual, "next_norm": (norm, normed)}}),
    }
    for label, (k, n, variants) in cases.items():
        weights = [random_int4(k, n, 128) for _ in range(sets_for(weight_bytes(k, n, 128)))]
        x = torch.randn(1, k, dtype=torch.float16, device=DEV)
        times = {}
        sms = num_sms(torch.device(DEV))
        for name, fused in variants.items():
            for per_sm in (8, 12, 16):
                plan = gemv_plan(n, k, 128, sms, head_dim if "rope" in fused else None, "norm_weight" in fused,
                                 warps_per_sm=per_sm)
                calls = [partial(w4a16_gemv, x, *w, 128, plan=plan, **fused) for w in weights]
                times[f"{name or 'plain'} {per_sm} warps/SM"] = round(bench_graph(calls) * 1e3, 2)
        print(json.dumps({"fusions": label, **times}), flush=True)
    from kernels.triton.w4a16_gemv import _gemv_kernel

    try:  # registers and spills of each compiled variant (Triton's cache layout differs between versions)
        for key, kernel in _gemv_kernel.device_caches[torch.cuda.current_device()][0].items():
            print("regs", kernel.n_regs, "spills", kernel.n_spills, str(key)[-60:])
    except Exception as exc:  # noqa: BLE001
        print("no register report:", exc)


def write_rows(path: str, copy_bw: float, **rows) -> None:
    """A JSON result of this bench: the card, date, command line and copy bandwidth, then ``rows``."""
    doc = {"card": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "command": "python3 bench/gemv.py " + " ".join(sys.argv[1:]), "copy_bandwidth_GBps": round(copy_bw, 1),
           **rows}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))


X16_LAYERS = {  # hidden, intermediate, heads, kv heads, head_dim, group: the fused layers' launches
    "7B": (4096, 11008, 32, 32, 128, 128),
    "8B": (4096, 14336, 32, 8, 128, 128),
    "SmolLM2": (576, 1536, 9, 3, 64, 32),
}


def time_x16(args, copy_bw: float) -> None:
    """Each launch of the fused decode layer (as engine/models/fused_decode.py makes it) with the half2 dot over
    fp16 x against the integer dot over x in 16-bit fixed point (``x16``), at the default plan and at other
    grid sizes; output error of both against the fp32 product."""
    from kernels.reference import quantize_x16

    sms = num_sms(torch.device(DEV))
    rows = []
    for name, (hidden, inter, heads, kv_heads, head_dim, group) in X16_LAYERS.items():
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        cache = torch.zeros(64, 16, kv_heads, head_dim, dtype=torch.float16, device=DEV)
        rope = {"positions": torch.tensor([7], device=DEV), "slot_mapping": torch.tensor([100], device=DEV),
                "cos_sin_cache": torch.rand(4096, head_dim, device=DEV), "k_cache": cache,
                "v_cache": cache.clone(), "q_size": q_size, "kv_size": kv_size, "head_dim": head_dim}
        launches = {  # K, N, fusions, head_dim of the plan
            "qkv": (hidden, q_size + 2 * kv_size, {"norm": True, "rope": rope}, head_dim),
            "o": (q_size, hidden, {"residual": True}, None),
            "gate/up": (hidden, 2 * inter, {"norm": True, "silu": True}, None),
            "down": (inter, hidden, {"residual": True}, None),
        }
        for launch, (k, n, spec, plan_head) in launches.items():
            weights = [random_int4(k, n, group) for _ in range(sets_for(weight_bytes(k, n, group)))]
            x = torch.randn(1, k, dtype=torch.float16, device=DEV)
            fused = {key: value for key, value in spec.items() if key not in ("norm", "residual")}
            if spec.get("norm"):
                norm = torch.rand(k, dtype=torch.float16, device=DEV) + 0.5
                fused.update(norm_weight=norm, normed=x * norm, eps=1e-5)
            if spec.get("residual"):
                fused["residual"] = torch.zeros(1, n, dtype=torch.float16, device=DEV)
            x16 = quantize_x16(fused.get("normed", x))
            nbytes = weight_bytes(k, n, group)
            row = {"layer": name, "launch": launch, "shape": f"{k}x{n} g{group}", "k": k, "n": n, "grids": []}
            # grids as gemv_plan's arguments (a tuned entry's keys): the rule, other warps an SM and K steps, the
            # rule before its one-wave cap, and the rule with its first weights loaded after the PDL wait
            grids = [{}] + [{"warps_per_sm": per_sm, "block_k": block_k} for per_sm in args.x16_warps
                            for block_k in (64, 128) if group >= 64 or block_k == 64] + [{"one_wave": False},
                                                                                           {"weights_first": False}]
            for args_of_grid in grids:
                plan = gemv_plan(n, k, group, sms, plan_head, spec.get("norm", False), **args_of_grid)
                if plan.one_step and "warps_per_sm" in args_of_grid:  # a one-step plan has no grid to choose
                    continue
                tag = ("default" if not args_of_grid else "uncapped-rule" if "one_wave" in args_of_grid else
                       "weights-after-wait" if "weights_first" in args_of_grid else
                       f"{args_of_grid['warps_per_sm']} warps/SM k{args_of_grid['block_k']}")
                grid = {"warps_per_sm": None, "block_k": 64, **args_of_grid}
                for dot, extra in (("half2", {}), ("x16", {"x16": x16})):
                    calls = [partial(w4a16_gemv, x, *w, group, plan=plan, **fused, **extra) for w in weights]
                    us = bench_graph(calls) * 1e3
                    row[f"{dot} {tag} us"] = grid[f"{dot}_us"] = round(us, 2)
                    if not args_of_grid:
                        row[f"{dot} x copy BW"] = round(nbytes / (us * 1e-6) / 1e9 / copy_bw, 3)
                row["grids"].append(grid)
            plain = {"normed": fused["normed"], "norm_weight": fused["norm_weight"]} if spec.get("norm") else {}
            exact = x.float() if not spec.get("norm") else fused["normed"].float()
            want = exact @ dequantize_int4(*weights[0], group).float()
            for dot, extra in (("half2", {}), ("x16", {"x16": x16})):
                got = w4a16_gemv(x, *weights[0], group, **plain, eps=1e-5, **extra).float()
                if spec.get("norm"):  # the launch scaled by 1 / rms(x): undo it for the error
                    got = got * x.float().pow(2).mean().add(1e-5).rsqrt().reciprocal()
                row[f"{dot} rel err"] = float((got - want).norm() / want.norm())
            row["x16 speed-up"] = round(row["half2 default us"] / row["x16 default us"], 3)
            for dot in ("half2", "x16"):
                timed = {key: us for key, us in row.items() if key.startswith(dot) and key.endswith(" us")}
                best = min(timed, key=timed.get)
                row[f"{dot} best"] = f"{best.removeprefix(dot + ' ').removesuffix(' us')}: {timed[best]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            del weights
            torch.cuda.empty_cache()
    write_rows(args.out or "bench/results/kernels_gemv_x16.json", copy_bw, x16=rows)
    if args.tuned_out:
        table = gemv_tuned_table(rows)
        shapes = sorted({f"{row['k']}x{row['n']}" for row in rows})
        write_tuned(args.tuned_out, torch.cuda.get_device_name(), table, shapes)
        print(f"tuned grids: {json.dumps(table)}", flush=True)


def gemv_tuned_table(rows: list[dict]) -> dict:
    """kernels/triton/tuned/w4a16_gemv.json's table for one card from ``--x16`` rows: per "KxN", the grid
    (warps an SM, K step, and whether the split is capped at one wave) with the least x16 time summed over the
    launches of that shape (the 7B and 8B o share one), where that beat the rule's grid by more than TUNED_MARGIN
    and kept the half2 dot within the same margin of the rule's: one entry serves both dots (a model whose rows
    cannot be x16 keeps the half2 dot; session 19 chose its H200 entries so by hand). An entry holds
    ``gemv_plan``'s arguments (the rule's where it omits one); ``launch_plan`` reads it at one row."""
    rule_key = (None, 64, True, True)
    by_shape: dict[str, dict[tuple, dict]] = {}
    for row in rows:
        for grid in row["grids"]:
            key = (grid["warps_per_sm"], grid["block_k"], grid.get("one_wave", True), grid.get("weights_first", True))
            shape = by_shape.setdefault(f"{row['k']}x{row['n']}", {})
            total = shape.setdefault(key, {"half2": 0.0, "x16": 0.0, "launches": 0})
            total["half2"] += grid["half2_us"]
            total["x16"] += grid["x16_us"]
            total["launches"] += 1
    table = {}
    for shape, grids in by_shape.items():
        rule = grids.get(rule_key)
        if rule is None:
            continue
        whole = [(key, t) for key, t in grids.items()  # grids timed for every launch of the shape
                 if key != rule_key and t["launches"] == rule["launches"]
                 and t["half2"] <= rule["half2"] / TUNED_MARGIN]
        if not whole:
            continue
        (warps_per_sm, block_k, one_wave, weights_first), best = min(whole, key=lambda item: item[1]["x16"])
        if best["x16"] < TUNED_MARGIN * rule["x16"]:
            entry = {"block_k": block_k}
            if warps_per_sm is not None:
                entry["warps_per_sm"] = warps_per_sm
            if not one_wave:
                entry["one_wave"] = False
            if not weights_first:
                entry["weights_first"] = False
            table[shape] = {"1": entry}
    return table


DENSE_SHAPES = {  # N x K of a Linear's fp16 weight: the fp16 7B layer (issue 15's fp16 target), heads, SmolLM2
    "7B qkv 12288x4096": (12288, 4096),
    "7B o 4096x4096": (4096, 4096),
    "7B gate/up 22016x4096": (22016, 4096),
    "7B down 4096x11008": (4096, 11008),
    "7B head 32000x4096": (32000, 4096),
    "8B head 128256x4096": (128256, 4096),
    "SmolLM2 qkv 960x576": (960, 576),
    "SmolLM2 gate/up 3072x576": (3072, 576),
    "SmolLM2 down 576x1536": (576, 1536),
    "SmolLM2 head 49152x576": (49152, 576),
}


def dense_plan_variants(n: int, k: int, sms: int):
    """Rows a thread, warps along K and the split (the rule's, one, twice the rule's): the basis of
    ``dense_gemv_plan``; up to 18 a shape, so the sweep of every shape fits one device call."""
    seen = set()
    for rows, warps in itertools.product((2, 4, 8), (4, 8)):
        block_k = min(256 * warps, next_pow2(k))
        steps = -(-k // block_k)
        rule = dense_gemv_plan(n, k, sms).split
        for split in (1, rule, min(steps, 2 * rule)):
            plan = DenseGemvPlan(rows, block_k, max(1, min(split, steps)), warps)
            if plan not in seen:
                seen.add(plan)
                yield plan


def int8_head_row(x: torch.Tensor, weights: list[torch.Tensor], copy_bw: float) -> dict:
    """The same head as int8 rows (--lm-head-quantization int8): the dense GEMV's int8 launch at one row, and the
    W8A16 matmul against cuBLAS's fp16 one at 32-256 rows of batched decode, at the rule's tile and, from 64
    rows, at the candidate tiles ``MANY_ROW_TILES``."""
    from engine.layers.linear import Int8Rows
    from kernels.triton.w8a16 import MANY_ROW_TILES, w8a16_matmul

    heads = [Int8Rows.quantize(w) for w in weights]
    n, k = weights[0].shape
    us = bench_graph([partial(dense_gemv, x, h.qweight, row_scales=h.scales) for h in heads]) * 1e3
    row = {"int8_us": round(us, 2), "int8_x_copy_bw": round((n * k + 2 * n + 2 * k) / (us * 1e-6) / 1e9 / copy_bw, 3)}
    for m in (32, 64, 128, 256):
        xm = torch.randn(m, k, dtype=torch.float16, device=DEV)
        int8 = bench_graph([partial(w8a16_matmul, xm, h.qweight, h.scales) for h in heads]) * 1e3
        fp16 = bench_graph([partial(torch.nn.functional.linear, xm, w) for w in weights]) * 1e3
        row[f"int8_m{m}_us"], row[f"cublas_m{m}_us"] = round(int8, 2), round(fp16, 2)
        for tile in MANY_ROW_TILES if m >= 64 else ():
            name = "x".join(str(tile[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + f"/{tile['num_warps']}w"
            timed = bench_graph([partial(w8a16_matmul, xm, h.qweight, h.scales, tile) for h in heads]) * 1e3
            row[f"int8_m{m}_{name}_us"] = round(timed, 2)
    return row


def bench_dense(args, copy_bw: float, sms: int) -> None:
    """The dense GEMV plain (STORE) against cuBLAS's F.linear, each over weights rotating past the L2; with
    ``--sweep``, its plan variants too."""
    rows = []
    for label, (n, k) in DENSE_SHAPES.items():
        if args.only and not any(part in label for part in args.only.split(",")):
            continue
        nbytes = 2 * n * k + 2 * k + 2 * n
        weights = [torch.randn(n, k, dtype=torch.float16, device=DEV) / k**0.5 for _ in range(sets_for(nbytes))]
        x = torch.randn(1, k, dtype=torch.float16, device=DEV)
        ours = bench_graph([partial(dense_gemv, x, w) for w in weights]) * 1e3
        cublas = bench_graph([partial(torch.nn.functional.linear, x, w) for w in weights]) * 1e3
        error = ((dense_gemv(x, weights[0]).float() - x.float() @ weights[0].float().t()).norm()
                 / (x.float() @ weights[0].float().t()).norm()).item()
        rule = dense_gemv_plan(n, k, sms)
        row = {"shape": label, "plan": str(rule), "ours_us": round(ours, 2),
               "cublas_us": round(cublas, 2), "x_cublas": round(cublas / ours, 3),
               "ours_x_copy_bw": round(nbytes / (ours * 1e-6) / 1e9 / copy_bw, 3),
               "cublas_x_copy_bw": round(nbytes / (cublas * 1e-6) / 1e9 / copy_bw, 3), "rel_error": error}
        uncapped = dense_gemv_plan(n, k, sms, one_wave=False)
        if uncapped != rule:  # the rule before its one-wave register cap
            row["uncapped_rule_us"] = round(bench_graph([partial(dense_gemv, x, w, plan=uncapped)
                                                         for w in weights]) * 1e3, 2)
        if "head" in label:
            row.update(int8_head_row(x, weights, copy_bw))
        if args.sweep:
            timed = sorted((bench_graph([partial(dense_gemv, x, w, plan=plan) for w in weights]) * 1e3, str(plan))
                           for plan in dense_plan_variants(n, k, sms))
            row["sweep"] = [{"us": round(t, 2), "plan": plan} for t, plan in timed[:6]]
            row["sweep_best_x_copy_bw"] = round(nbytes / (timed[0][0] * 1e-6) / 1e9 / copy_bw, 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del weights
        torch.cuda.empty_cache()
    write_rows(args.out or "bench/results/kernels_gemv_dense.json", copy_bw, dense=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default bench/results/kernels_gemv.json (--dense: "
                                                    "kernels_gemv_dense.json)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated substrings of the shape names to run")
    parser.add_argument("--fusions", action="store_true", help="only time the fused variants on 7B shapes")
    parser.add_argument("--dense", action="store_true", help="the fp16 GEMV against cuBLAS instead")
    parser.add_argument("--x16", action="store_true", help="the fused layer's launches, half2 dot against x16")
    parser.add_argument("--x16-warps", default="12,16,32", type=lambda text: [int(v) for v in text.split(",")],
                        help="with --x16: the grids (warps an SM) timed beside the default plan")
    parser.add_argument("--tuned-out", default=None,
                        help="with --x16: put this card's fastest grids into this tuned table (a copy of "
                             "kernels/triton/tuned/w4a16_gemv.json; the timed shapes' entries are replaced)")
    args = parser.parse_args()
    if args.fusions:
        time_fusions()
        return
    if args.x16:
        torch.manual_seed(0)
        time_x16(args, copy_bandwidth())
        return
    if args.dense:
        torch.manual_seed(0)
        bench_dense(args, copy_bandwidth(), num_sms(torch.device(DEV)))
        return
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    sms = num_sms(torch.device(DEV))
    print(f"card {torch.cuda.get_device_name()}  copy bandwidth {copy_bw:.0f} GB/s  SMs {sms}", flush=True)
    rows, sweeps = [], {}
    for label, (k, n, group) in SHAPES.items():
        if args.only and not any(part in label for part in args.only.split(",")):
            continue
        count = sets_for(weight_bytes(k, n, group))
        weights = [random_int4(k, n, group) for _ in range(count)]
        x = torch.randn(1, k, dtype=torch.float16, device=DEV)
        nbytes = weight_bytes(k, n, group)
        row = {"shape": label, "plan": str(gemv_plan(n, k, group, sms))}
        row.update(time_all(x, weights, k, n, group, min(count, 16)))
        if row["ours_us"] is None:
            continue
        row["ours_x_copy_bw"] = round(nbytes / (row["ours_us"] * 1e-6) / 1e9 / copy_bw, 3)
        for peer in ("previous", "gemlite", "tinygemm", "fp16"):
            if row.get(f"{peer}_us"):
                row[f"x_{peer}"] = round(row[f"{peer}_us"] / row["ours_us"], 3)
        if args.sweep:
            timed = []
            for plan in sweep_plans(k, n, group, sms):
                try:
                    timed.append((time_ours(x, weights, group, plan) * 1e3, plan))
                except Exception as exc:  # noqa: BLE001
                    print(f"  {plan}: {exc}")
            timed.sort(key=lambda t: t[0])
            sweeps[label] = [{"us": round(t, 2), "plan": str(p)} for t, p in timed[:8]]
            best = timed[0]
            row["sweep_best_us"], row["sweep_best_plan"] = round(best[0], 2), str(best[1])
            row["sweep_best_x_copy_bw"] = round(nbytes / (best[0] * 1e-6) / 1e9 / copy_bw, 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del weights
        torch.cuda.empty_cache()
    results = []
    for row in rows:
        target = TARGETS.get(row["shape"])
        if target is None:
            continue
        bw, x_gemlite, x_tiny = target
        results.append({"name": f"w4a16 M=1 {row['shape']}: fraction of copy BW", "value": row["ours_x_copy_bw"],
                        "target": f">= {bw}", "pass": row["ours_x_copy_bw"] >= bw})
        for peer, want in (("gemlite", x_gemlite), ("tinygemm", x_tiny)):
            value = row.get(f"x_{peer}")
            results.append({"name": f"w4a16 M=1 {row['shape']}: speed vs {peer}", "value": value,
                            "target": f">= {want}", "pass": value is not None and value >= want})
    write_rows(args.out or "bench/results/kernels_gemv.json", copy_bw, results=results, shapes=rows, sweep=sweeps)
    for r in results:
        print(f"{r['name']:<70} {r['value']} {r['target']} {r['pass']}")


if __name__ == "__main__":
    main()
