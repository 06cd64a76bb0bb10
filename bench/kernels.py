"""Kernel benchmark on a GPU: issue-8 targets at 7B shapes against copy bandwidth, cuBLAS and SDPA.

Run on the GPU machine: ``python3 bench/kernels.py [--out bench/results/kernels.json] [--sweep sweep.json]``.
Times are medians of CUDA-graph replays (``bench_graph``): each graph calls the op over several input sets
that together exceed the L2 several times (so operands come from HBM, not cache), and graph replay removes the
Python launch overhead that would otherwise dominate microsecond kernels (the engine replays decode steps as
CUDA graphs too). The baselines (cuBLAS fp16 matmul, SDPA, copy) are timed the same way. Copy bandwidth is
measured in the same run (a 2 GiB device-to-device copy, bytes read + written).
Prints a table last and writes {"card", "date", "command", "copy_bandwidth_GBps", "results", "info"}.
``--sweep`` also times a few tile/split variants per kernel (used to pick the launch heuristics); ``--sweep-mma``
the transposed W4A16 kernel's tiles at 32-256 rows (``--only batched`` times the shipped path alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import traceback
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import reference, triton_ops
from kernels.triton import decode_attention as decode_mod
from kernels.triton import prefill_attention as prefill_mod
from kernels.triton import w4a16 as w4a16_mod
from kernels.triton import w4a16_mma

DEV = "cuda"
DTYPE = torch.float16
W4A16_SHAPES = {
    "4096x4096 q/o": (4096, 4096),
    "4096x22016 gate/up": (4096, 22016),
    "11008x4096 down": (11008, 4096),
    "4096x12288 qkv": (4096, 12288),
    "4096x6144 qkv-gqa": (4096, 6144),
}
GROUP = 128
PREFILL = (8, 2048)  # sequences x tokens, fresh prompts
SMALL = (8192, 4096, 11008, 16384)  # tokens, hidden, intermediate; tokens for rotary/cache


@dataclass
class Result:
    name: str
    value: float
    unit: str
    target: str
    passed: bool | None

    def row(self) -> dict:
        d = asdict(self)
        d["pass"] = d.pop("passed")
        return d


L2_ROTATE_BYTES = 200 << 20  # input sets per graph add up to > 3x the H200's 60 MB L2


def bench_ms(fn) -> float:
    """do_bench median (flushes L2 before each call); used where a graph cannot be captured."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(calls: list, reps: int = 15) -> float:
    """Median ms per call of ``calls`` (closures over distinct input sets) replayed as one CUDA graph."""
    calls = calls * max(1, -(-8 // len(calls)))  # at least 8 calls per replay to amortise the graph launch
    for call in calls:
        call()  # compile, autotune and allocate per-weight scratch (split-K counters) outside the capture
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
    except Exception:  # noqa: BLE001 (fall back to per-call timing)
        traceback.print_exc()
        return statistics.median(bench_ms(c) for c in calls[:2])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)


def sets_for(nbytes: int) -> int:
    """How many input sets of ``nbytes`` make one graph's working set exceed the L2 several times."""
    return max(2, -(-L2_ROTATE_BYTES // max(nbytes, 1)))


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read plus written (do_bench: a graph of
    such copies read low, 2.8 TB/s, on a cold GPU where do_bench gave the 4.3 TB/s seen before)."""
    src = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    bench_ms(lambda: dst.copy_(src))  # let the clocks settle first
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def at_least(name, value, unit, target) -> Result:
    return Result(name, round(value, 4), unit, f">= {target}", bool(value >= target))


def at_most(name, value, unit, target) -> Result:
    return Result(name, round(value, 4), unit, f"<= {target}", bool(value <= target))


def info(name, value, unit) -> Result:
    return Result(name, round(value, 4), unit, "info", None)


def random_int4(k: int, n: int, group: int = GROUP):
    """Random packed int4 weights (every bit pattern), scales and integer zero points in the kernel layout."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=DEV)
    scales = (torch.rand(k // group, n, device=DEV) * 0.01 + 0.001).to(DTYPE)
    zeros = torch.randint(5, 11, (k // group, n), device=DEV).to(DTYPE)
    return qweight, scales, zeros


def weight_sets(k: int, n: int) -> tuple[list, list]:
    """Packed int4 and fp16 [K, N] weights, enough sets of each to exceed the L2 (operands come from HBM)."""
    packed = [random_int4(k, n) for _ in range(sets_for(int4_bytes(1, k, n)))]
    dense = [torch.randn(k, n, dtype=DTYPE, device=DEV) for _ in range(sets_for(2 * k * n))]
    return packed, dense


def int4_bytes(m: int, k: int, n: int) -> int:
    return k * n // 2 + 2 * (k // GROUP) * n * 2 + m * k * 2 + m * n * 2


def bench_w4a16(copy_bw: float, out: list, extra: list) -> None:
    for label, (k, n) in W4A16_SHAPES.items():
        packed, dense = weight_sets(k, n)
        for m in [1, 2, 4, 8, 16, 256, 1024, 4096]:
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            t_q = bench_graph([partial(triton_ops.w4a16_matmul, x, *p, GROUP) for p in packed])
            t_h = bench_graph([partial(torch.matmul, x, w) for w in dense])
            if m == 1:
                frac = int4_bytes(m, k, n) / t_q / 1e6 / copy_bw
                out.append(at_least(f"w4a16 M=1 {label}: fraction of copy BW", frac, "x copy BW", 0.75))
            if m <= 16:
                out.append(at_least(f"w4a16 M={m} {label}: speedup vs fp16 matmul", t_h / t_q, "x", 3.0))
            else:
                out.append(at_most(f"w4a16 M={m} {label}: time / fp16 matmul", t_q / t_h, "x", 1.3))
            extra.append(info(f"w4a16 M={m} {label}: time", t_q * 1e3, "us"))
            extra.append(info(f"fp16 matmul M={m} {label}: time", t_h * 1e3, "us"))


BATCHED_SHAPES = {  # issue 16: the 7B and 8B shapes a batched decode step multiplies
    "8B qkv 4096x6144": (4096, 6144),
    "8B o 4096x4096": (4096, 4096),
    "8B gate/up 4096x28672": (4096, 28672),
    "8B down 14336x4096": (14336, 4096),
    "7B qkv 4096x12288": (4096, 12288),
    "7B gate/up 4096x22016": (4096, 22016),
    "7B down 11008x4096": (11008, 4096),
}


def bench_w4a16_batched(out: list, extra: list) -> None:
    """Issue 16: the shipped W4A16 path at 16-256 rows against fp16 cuBLAS on the same shape, as speed ratios
    (fp16 time / W4A16 time): >= 2 at 16 and 32 rows, >= 0.9 at 64, 128 and 256."""
    for label, (k, n) in BATCHED_SHAPES.items():
        packed, dense = weight_sets(k, n)
        for m in (16, 32, 64, 128, 256):
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            t_q = bench_graph([partial(triton_ops.w4a16_matmul, x, *p, GROUP) for p in packed])
            t_h = bench_graph([partial(torch.matmul, x, w) for w in dense])
            out.append(at_least(f"w4a16 M={m} {label}: speed vs fp16 cuBLAS", t_h / t_q, "x", 2.0 if m <= 32 else 0.9))
            extra.append(info(f"w4a16 M={m} {label}: time", t_q * 1e3, "us"))
            extra.append(info(f"fp16 matmul M={m} {label}: time", t_h * 1e3, "us"))
        del packed, dense
        torch.cuda.empty_cache()


def paged_kv(batch: int, ctx: int, kv_heads: int, head_dim: int = 128, block_size: int = 16):
    blocks = batch * ctx // block_size
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, dtype=DTYPE, device=DEV)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks, device=DEV).to(torch.int32).reshape(batch, ctx // block_size)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return k_cache, v_cache, table, lens


def paged_kv_sets(batch: int, ctx: int, kv_heads: int) -> tuple[list, int]:
    """Paged K/V sets of ``batch`` x ``ctx`` tokens for a graph to rotate over (two where one would stay in L2),
    and the bytes of K and V one decode-attention call reads."""
    kv_bytes = 2 * batch * ctx * kv_heads * 128 * 2
    return [paged_kv(batch, ctx, kv_heads) for _ in range(2 if kv_bytes < L2_ROTATE_BYTES else 1)], kv_bytes


DECODE_CASES = [
    ("batch 64 x ctx 4096, MHA 32/32", 64, 4096, 32, 0.70),
    ("batch 64 x ctx 4096, GQA 32/8", 64, 4096, 8, 0.70),
    ("batch 1 x ctx 32768, MHA 32/32", 1, 32768, 32, 0.50),
    ("batch 1 x ctx 32768, GQA 32/8", 1, 32768, 8, 0.50),
]


def bench_decode(copy_bw: float, out: list, extra: list, config: dict | None = None) -> None:
    for label, batch, ctx, kv_heads, target in DECODE_CASES:
        sets, kv_bytes = paged_kv_sets(batch, ctx, kv_heads)
        q = torch.randn(batch, 32, 128, dtype=DTYPE, device=DEV)
        ms = bench_graph(
            [partial(decode_mod.decode_attention, q, *kv, 128**-0.5, config=config) for kv in sets]
        )
        out.append(
            at_least(
                f"paged decode {label}: fraction of copy BW",
                kv_bytes / ms / 1e6 / copy_bw,
                "x copy BW",
                target,
            )
        )
        extra.append(info(f"paged decode {label}: time", ms * 1e3, "us"))
        del sets


SINGLE_STREAM_CONTEXTS = (128, 256, 512, 1024, 2048)  # batch-1 decode's contexts in bench/latency.py and chats


# the default split with shorter tiles or fewer stages, and with longer tiles over more warps: a 128- or 256-key
# tile is one round trip where a 64-key partition walk is two to four (at 256 keys, one live partition a head and
# no combine step); 4 stages of 128-key K and V tiles would not fit in an SM's shared memory. PREFETCH_TILES 2: two
# tiles loaded before the wait, two at least a partition (at 129-256 keys one partition and no combine step, which
# cost ~2.6 us on the 7B in session 33)
SINGLE_STREAM_HEADS = ((32, 32, 128), (32, 8, 128), (9, 3, 64))  # (heads, KV heads, head size): 7B, 8B, SmolLM2
SINGLE_STREAM_TILES = [{"BLOCK_N": 32}, {"BLOCK_N": 32, "num_stages": 2}, {"num_stages": 2},
                       {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
                       {"BLOCK_N": 128, "num_warps": 8, "num_stages": 1},
                       {"BLOCK_N": 256, "num_warps": 8, "num_stages": 1, "PREFETCH": False},
                       {"BLOCK_N": 256, "num_warps": 16, "num_stages": 1},
                       {"BLOCK_N": 128, "num_warps": 8, "num_stages": 1, "PREFETCH_TILES": 2},
                       {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "PREFETCH_TILES": 2}]


def bench_decode_single_stream(extra: list, max_ctx: int = 4096) -> None:
    """Batch-1 decode attention at the short contexts of single-stream decoding, on a block table as wide as
    the engine's graphs capture (``max_ctx``), over split counts: the default (``choose_splits``) against fixed
    ones, so the in-kernel partitioning is timed where it matters for issue 15 (a layer's attention is one of
    its five launches), the default with its first tile of keys loaded after waiting on the previous kernel
    (as before session 20) rather than before, and the default split with shorter tiles or fewer stages
    (``SINGLE_STREAM_TILES``: at 64-512 keys a 64-key tile leaves 1-8 partitions a head, each of 32 KB, and the
    7B step's 32 attention launches took 7.9 us each, eager, H100 session 26). Informational rows only."""
    block_size = 16
    cases = {"default": (None, None), "default, first tile after the wait": (None, {"PREFETCH": False}),
             **{f"{n} splits": (n, None) for n in (1, 2, 4, 8, 16)},
             **{"default, " + ",".join(f"{k}={v}" for k, v in tile.items()): (None, tile)
                for tile in SINGLE_STREAM_TILES}}
    for heads, kv_heads, head_dim in SINGLE_STREAM_HEADS:
        k_cache = torch.randn(max_ctx // block_size, block_size, kv_heads, head_dim, dtype=DTYPE, device=DEV)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(max_ctx // block_size, device=DEV).to(torch.int32)[None, :]
        q = torch.randn(1, heads, head_dim, dtype=DTYPE, device=DEV)
        default = decode_mod._config(block_size, head_dim)
        for ctx in SINGLE_STREAM_CONTEXTS:
            lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
            times = {}
            for name, (splits, variant) in cases.items():
                config = {**default, **variant} if variant else None
                try:
                    ms = bench_graph([partial(decode_mod.decode_attention, q, k_cache, v_cache, table, lens,
                                              head_dim**-0.5, num_splits=splits, config=config)])
                except Exception as exc:  # noqa: BLE001 (a variant that does not fit is reported, not fatal)
                    print(f"decode1 ctx {ctx} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                times[name] = round(ms * 1e3, 2)
            best = min(times, key=times.get)
            extra.append(info(f"paged decode batch 1 x ctx {ctx}, {heads}/{kv_heads} heads of {head_dim}: default "
                              f"({times['default']} us), best {best}", times[best], "us"))
            print(json.dumps({"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "ctx": ctx, **times}),
                  flush=True)
        del k_cache, v_cache


BATCHED_DECODE_CONTEXTS = (128, 192, 256)  # bench/throughput.py's 128 x (128 + 128): contexts 128-256


def decode_config_times(q, batch: int, ctx: int, kv_heads: int, variants: list[dict], copy_bw: float) -> dict:
    """Fraction of copy bandwidth of each decode-attention config variant ({}: the default) at one case."""
    default = decode_mod._config(16)
    sets, kv_bytes = paged_kv_sets(batch, ctx, kv_heads)
    times = {}
    for variant in variants:
        try:
            ms = bench_graph([partial(decode_mod.decode_attention, q, *kv, 128**-0.5, config={**default, **variant})
                              for kv in sets])
        except Exception as exc:  # noqa: BLE001 (a variant that does not fit is reported, not fatal)
            print(f"decode batch {batch} ctx {ctx} {variant}: {type(exc).__name__}", flush=True)
            continue
        name = "default" if not variant else ",".join(f"{k}={v}" for k, v in variant.items())
        times[name] = round(kv_bytes / ms / 1e6 / copy_bw, 3)
    return times


# (batch, ctx): issue 16's 128 x (128 + 128) contexts with every variant, then the cases the default was chosen
# on (DECODE_CASES) with its own tile at each pipelining depth: whether fewer stages (faster at short contexts,
# session 22) cost anything where a program loops over many tiles
DECODE_N_CASES = [(128, ctx) for ctx in BATCHED_DECODE_CONTEXTS] + [(64, 4096), (1, 32768)]
SHORT_VARIANTS = [{}] + [{"BLOCK_N": n, "num_stages": s, "num_warps": w}
                         for n in (32, 64) for s in (1, 2, 3) for w in (4, 8)] + [{"num_warps": 8}]
STAGE_VARIANTS = [{}] + [{"num_stages": s} for s in (1, 2, 3)]


def bench_decode_batched(copy_bw: float, extra: list) -> None:
    """Decode attention at the short contexts of issue 16's throughput run (128 sequences; a 7B (MHA) step
    reads ~12 GB of keys and values over its 32 layers) against the config variants around the default (keys
    per tile, pipelining stages, warps), and at the default's own long-context cases with fewer stages: the
    default's 4 stages were chosen on 64 x 4,096, where a program loops over many tiles; at 128-256 tokens it
    has 2-4. Informational rows (fraction of copy bandwidth)."""
    for kv_heads in (32, 8):
        for batch, ctx in DECODE_N_CASES:
            q = torch.randn(batch, 32, 128, dtype=DTYPE, device=DEV)
            variants = SHORT_VARIANTS if ctx in BATCHED_DECODE_CONTEXTS else STAGE_VARIANTS
            times = decode_config_times(q, batch, ctx, kv_heads, variants, copy_bw)
            best = max(times, key=times.get)
            label = f"paged decode batch {batch} x ctx {ctx}, 32/{kv_heads} heads"
            extra.append(info(f"{label}: default, fraction of copy BW", times.get("default", float("nan")), "x"))
            extra.append(info(f"{label}: best ({best}), fraction of copy BW", times[best], "x"))
            print(json.dumps({"batch": batch, "kv_heads": kv_heads, "ctx": ctx, **times}), flush=True)


def sdpa(q, k, v):
    kwargs = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)


def bench_prefill(out: list, extra: list, config: dict | None = None) -> None:
    (batch, seq), heads = PREFILL, 32
    for kv_heads in (32, 8):
        k_cache, v_cache, table, lens = paged_kv(batch, seq, kv_heads)
        q = torch.randn(batch * seq, heads, 128, dtype=DTYPE, device=DEV)
        qsl = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=DEV)
        # the same K/V laid out contiguously for SDPA: [batch, kv_heads, seq, 128]
        k_c = k_cache[table.long()].reshape(batch, seq, kv_heads, 128).transpose(1, 2).contiguous()
        v_c = v_cache[table.long()].reshape(batch, seq, kv_heads, 128).transpose(1, 2).contiguous()
        q_c = q.reshape(batch, seq, heads, 128).transpose(1, 2).contiguous()
        ours = bench_graph(
            [
                partial(
                    prefill_mod.prefill_attention,
                    q,
                    k_cache,
                    v_cache,
                    table,
                    qsl,
                    lens,
                    128**-0.5,
                    config=config,
                )
            ]
        )
        ref = bench_graph([partial(sdpa, q_c, k_c, v_c)])
        flops = 4 * batch * heads * seq * seq * 128 / 2
        label = f"prefill {batch}x{seq} {heads}/{kv_heads} heads"
        out.append(at_most(f"{label}: time / SDPA (contiguous)", ours / ref, "x", 1.5))
        extra.append(info(f"{label}: ours", flops / ours / 1e9, "TFLOP/s"))
        extra.append(info(f"{label}: SDPA", flops / ref / 1e9, "TFLOP/s"))


def bench_small_ops(copy_bw: float, out: list) -> None:
    tokens, hidden, inter, t = SMALL
    x = torch.randn(tokens, hidden, dtype=DTYPE, device=DEV)
    res = torch.randn_like(x)
    w = torch.randn(hidden, dtype=DTYPE, device=DEV)
    ms = bench_ms(lambda: triton_ops.rms_norm(x, w, 1e-6, res))
    out.append(
        at_least(
            f"rms_norm+residual {tokens}x{hidden}: fraction of copy BW",
            4 * x.numel() * 2 / ms / 1e6 / copy_bw,
            "x copy BW",
            0.60,
        )
    )
    gu = torch.randn(tokens, 2 * inter, dtype=DTYPE, device=DEV)
    ms = bench_ms(lambda: triton_ops.silu_and_mul(gu))
    out.append(
        at_least(
            f"silu_and_mul {tokens}x{inter}: fraction of copy BW",
            1.5 * gu.numel() * 2 / ms / 1e6 / copy_bw,
            "x copy BW",
            0.60,
        )
    )
    q = torch.randn(t, 32, 128, dtype=DTYPE, device=DEV)
    k = torch.randn(t, 8, 128, dtype=DTYPE, device=DEV)
    pos = torch.randint(0, 4 * t, (t,), device=DEV)
    cache = torch.randn(4 * t, 128, device=DEV)
    ms = bench_ms(lambda: triton_ops.rotary_embedding(pos, q, k, cache))
    nbytes = 2 * (q.numel() + k.numel()) * 2 + t * 128 * 4 + t * 8
    out.append(
        at_least(
            f"rotary q32/k8 x {t} tokens: fraction of copy BW", nbytes / ms / 1e6 / copy_bw, "x copy BW", 0.60
        )
    )
    kc = torch.randn(t // 16 * 2, 16, 8, 128, dtype=DTYPE, device=DEV)
    vc = torch.randn_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device=DEV)[:t]
    ms = bench_ms(lambda: triton_ops.reshape_and_cache(k, k, kc, vc, slots))
    out.append(
        at_least(
            f"reshape_and_cache {t} x 8 x 128: fraction of copy BW",
            4 * k.numel() * 2 / ms / 1e6 / copy_bw,
            "x copy BW",
            0.60,
        )
    )


PLANES_SWEEP = [  # (BLOCK_N, warps, stages, programs per SM (sets split-K), serial reduce, reused counters)
    (128, 4, 3, 2, True, True),
    (128, 4, 3, 4, True, True),
    (256, 4, 3, 1, True, True),
    (256, 4, 3, 2, True, True),
    (256, 4, 3, 4, True, True),
    (256, 8, 3, 2, True, True),
    (256, 8, 3, 4, True, True),
    (128, 4, 4, 4, True, True),
    (128, 4, 3, 4, False, True),
    (128, 4, 3, 4, True, False),
    (64, 4, 3, 4, True, True),
]


def planes_cfg(m: int, n: int, k: int, bn: int, warps: int, stages: int, per_sm: int, serial: bool,
               reuse_lock: bool, sms: int) -> dict:
    tiles = -(-n // bn)
    split = max(1, min(k // 128, -(-per_sm * sms // tiles), 64))
    return {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": 128, "num_warps": warps, "num_stages": stages,
            "split": split, "serial": serial, "reuse_lock": reuse_lock}


def sweep(copy_bw: float, path: str) -> None:
    """Times planes-kernel variants at M = 1 and 16 against cuBLAS; writes
    {"w4a16_planes": [{shape, m, config, us, frac, vs_fp16}]} to ``path`` after each shape."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    found: dict = {"w4a16_planes": []}
    for label, (k, n) in W4A16_SHAPES.items():
        packed, dense = weight_sets(k, n)
        for m in (1, 16):
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            t_h = bench_graph([partial(torch.matmul, x, w) for w in dense])
            variants = [planes_cfg(m, n, k, *v, sms=sms) for v in PLANES_SWEEP]
            for cfg in variants:
                try:
                    ms = bench_graph(
                        [partial(w4a16_mod.w4a16_matmul, x, *p, GROUP, path="planes", config=cfg) for p in packed]
                    )
                    frac = int4_bytes(m, k, n) / ms / 1e6 / copy_bw
                    found["w4a16_planes"].append({"shape": label, "m": m, "config": cfg, "us": ms * 1e3,
                                                  "frac": frac, "vs_fp16": t_h / ms, "fp16_us": t_h * 1e3})
                except Exception as exc:  # noqa: BLE001 (a variant that fails to compile is skipped)
                    found["w4a16_planes"].append({"shape": label, "m": m, "config": cfg, "error": repr(exc)[:300]})
        Path(path).write_text(json.dumps(found, indent=1))
        best = {}
        for r in found["w4a16_planes"]:
            if r["shape"] == label and "us" in r:
                key = r["m"]
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
        for key, r in sorted(best.items()):
            print(f"sweep {label} M={key}: best {r['us']:.2f} us frac {r['frac']:.3f} x{r['vs_fp16']:.2f} "
                  f"vs fp16 ({r['fp16_us']:.1f} us) {r['config']}", flush=True)


MMA_SWEEP = [  # BLOCK_M cap, BLOCK_N, warps, stages: the transposed kernel's tiles timed by --sweep-mma
    # every tile that won a case of session 16's sweep (21 cases); its 256-row tiles (before the one-split
    # registers) never came within 5% of the best (each tile costs ~25 compiles a sweep, which bound its length)
    (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3), (128, 64, 4, 2),
    # a wider weight tile a warpgroup (two 64-row wgmmas each step): x is staged once for 128 weight columns
    # instead of 64; compiled for sm_90 without spills (181-184 registers at BLOCK_M 64)
    (64, 128, 4, 3),
    # x copied by TMA (no address arithmetic a step, ~100 registers), and with a warp-specialized K loop (one
    # split only: Triton does not split a loop whose kernel keeps the split-K path); with split-K, x by TMA
    # gave NaN at 128-row tiles (sessions 14 and 15): the error check keeps such rows out of the table
    (128, 64, 4, 2, {"X_TMA": True}), (128, 64, 4, 3, {"X_TMA": True, "WARP_SPECIALIZE": True}),
    # 256 rows in one tile, 128 weight columns over two warpgroups (wgmma 64 x 256 each): every weight unpacked
    # once for 256 rows instead of twice. At 256 rows the best 128-row tiles ran at 0.67-0.79x of fp16 cuBLAS
    # (session 22, H100), about the sum of the tensor-core time and the unpack's issue time. Since session 17's
    # one-split registers these compile for sm_90 without spills (x by TMA: 167-170 registers, 137-209 KB of
    # shared memory, one program an SM)
    (256, 128, 8, 2, {"X_TMA": True, "split": 1}), (256, 128, 8, 3, {"X_TMA": True, "split": 1}),
    # the same 256 rows over one warpgroup and 64 weight columns (one wgmma of 64 x 256 a K step: the weight still
    # unpacked once for 256 rows, 165-167 registers): twice the programs of the 128-column tile, for the waves.
    # Session 23 (H100): 256 x 128 gave the 8B gate/up (224 tiles on 132 SMs) 0.96x fp16 but the 7B gate/up (172
    # tiles, two waves, the second a third full) 0.72x and the 7B qkv (96 tiles, one wave 73% full) 0.79x
    (256, 64, 4, 2, {"X_TMA": True, "split": 1}), (256, 64, 4, 3, {"X_TMA": True, "split": 1}),
    # and with the rule's split, where the tiles leave SMs idle (8B o: 64 tiles of 64 columns, 8B qkv 96; at 256
    # rows 0.66-0.72x of fp16): since the last program sums the partials 64 rows at a time they compile without
    # spills at 2-16 splits (204-222 registers; the whole 256-row sum spilled)
    (256, 64, 4, 3, {"X_TMA": True}), (256, 128, 8, 3, {"X_TMA": True}),
]
# deeper pipelines where rows are few: a split-K program of 16-64 rows runs only 4-8 K steps, so the loop's
# start (stages - 1 loads in flight) is much of its time; session 23's H100 sweep found 3 stages 15-35% faster than
# 2 at 16-32 rows (8B down at 16 rows, 3 splits a SM: 42.7 -> 27.1 us) and never tried more. These compile for sm_90
# without spills (Triton 3.9: 47-130 registers, 28-138 KB of shared memory at BLOCK_M 16-64, 1 or 4 splits)
MMA_SWEEP_DEEP = [(64, 64, 4, 4), (64, 64, 4, 5), (64, 64, 4, 6), (64, 128, 8, 4), (64, 128, 8, 5),
                  (64, 128, 4, 4)]
DEEP_MAX_ROWS = 64  # MMA_SWEEP_DEEP is swept at this many rows or fewer
WHOLE_TILE_ROWS = 128  # tiles whose BLOCK_M cap is above this are swept only at more rows (below, a 128 tile's)
MMA_SWEEP_ROWS = (16, 32, 64, 128, 256)  # at 16 against the planes kernel, which the shipped path runs there
MMA_SWEEP_SLOTS = (3,)  # besides the rule's split (the tiles fill each SM once): the split for 3 programs an SM


def mma_sweep_configs(m: int, n: int, k: int, sms: int) -> list[dict]:
    """Every MMA_SWEEP tile at ``m`` rows with the rule's split, and with the split that gives each SM 3
    programs where that differs (a loop bound by latency at few tiles wants more programs in flight; issue 16's
    17-64 rows; session 14 found the loop latency-bound at 1.5 warps a scheduler)."""
    configs = []
    for tile in MMA_SWEEP + (MMA_SWEEP_DEEP if m <= DEEP_MAX_ROWS else []):
        if tile[0] > WHOLE_TILE_ROWS >= m:
            continue
        rule = mma_cfg(m, n, k, *tile, sms=sms)
        tiles = -(-m // rule["BLOCK_M"]) * -(-n // rule["BLOCK_N"])
        for slots in (None, *(MMA_SWEEP_SLOTS if m <= 64 else ())):  # (at 128-256 rows tiles are many)
            config = rule if slots is None else mma_cfg(m, n, k, *tile, sms=sms, split=-(-slots * sms // tiles))
            if config not in configs:
                configs.append(config)
    return configs


def mma_cfg(m: int, n: int, k: int, bm_cap: int, bn: int, warps: int, stages: int, flags: dict | None = None,
            *, sms: int, split: int | None = None) -> dict:
    """A MMA_SWEEP tile's launch config at ``m`` rows (with ``split``, that split), as the launcher makes it from
    a tuned tile."""
    tile = {"BLOCK_M": bm_cap, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, **(flags or {}),
            **({"split": split} if split else {})}
    return w4a16_mma.mma_config(m, n, k, sms, tile)


def sweep_mma(path: str, tuned_out: str | None = None, only: str = "",
              rows: tuple[int, ...] = MMA_SWEEP_ROWS) -> None:
    """Times the transposed kernel's tiles (w4a16_mma.py) at ``rows`` (16-256) on the issue-16 shapes (``only``:
    those whose names hold one of its comma-separated parts) against cuBLAS and the shipped path; writes
    {"w4a16_mma": [{shape, m, config, us, vs_fp16, fp16_us, shipped_us}]}, and with ``tuned_out`` this card's
    tiles for the swept shapes and rows there (``tuned_table``; the other entries stay)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    found: dict = {"w4a16_mma": []}
    shapes = {label: kn for label, kn in BATCHED_SHAPES.items()
              if not only or any(part in label for part in only.split(","))}
    swept: list[str] = []
    for label, (k, n) in shapes.items():
        packed, dense = weight_sets(k, n)
        for m in rows:
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            t_h = bench_graph([partial(torch.matmul, x, w) for w in dense])
            t_s = bench_graph([partial(triton_ops.w4a16_matmul, x, *p, GROUP) for p in packed])
            # at 16 rows or fewer a tabled tile replaces the planes kernel, so "shipped" may be the tile itself
            # (a re-sweep then dropped every such entry, session 23): the planes kernel is timed on its own
            planes = {}
            if m <= w4a16_mod.PLANES_MAX_M:
                calls = [partial(w4a16_mod.w4a16_matmul, x, *p, GROUP, path="planes") for p in packed]
                planes["planes_us"] = bench_graph(calls) * 1e3
            expected = reference.w4a16_matmul(x.float(), *packed[0], GROUP)  # [m, n] float32
            timings = []  # (not ``rows``: that is the row counts this loop runs over)
            for cfg in mma_sweep_configs(m, n, k, sms):
                try:
                    got = w4a16_mod.w4a16_matmul(x, *packed[0], GROUP, path="mma", config=cfg).float()
                    error = ((got - expected).norm() / expected.norm()).item()  # NaN stays NaN
                    ms = bench_graph(
                        [partial(w4a16_mod.w4a16_matmul, x, *p, GROUP, path="mma", config=cfg) for p in packed])
                    timings.append({"shape": label, "m": m, "config": cfg, "us": ms * 1e3, "vs_fp16": t_h / ms,
                                    "fp16_us": t_h * 1e3, "shipped_us": t_s * 1e3, "rel_error": error, **planes})
                except Exception as exc:  # noqa: BLE001 (a variant that fails to compile is skipped)
                    timings.append({"shape": label, "m": m, "config": cfg, "error": repr(exc)[:300]})
            found["w4a16_mma"] += timings
            timed = [r for r in timings if "us" in r and r["rel_error"] < 2e-3]
            if timed:
                best = min(timed, key=lambda r: r["us"])
                print(f"sweep-mma {label} M={m}: best {best['us']:.1f} us ({best['vs_fp16']:.2f}x fp16 "
                      f"{t_h * 1e3:.1f} us; shipped {t_s * 1e3:.1f} us) {best['config']}", flush=True)
        Path(path).write_text(json.dumps(found, indent=1))  # after each shape: a timeout keeps what was swept
        swept.append(f"{k}x{n}")
        if tuned_out:
            write_tuned(tuned_out, torch.cuda.get_device_name(), tuned_table(found["w4a16_mma"], sms), swept,
                        rows)
        del packed, dense
        torch.cuda.empty_cache()


TUNED_MARGIN = 0.97  # a swept tile enters the table only where it beat the rule's by more than 3% (run noise)


def tuned_table(rows: list[dict], sms: int) -> dict:
    """kernels/triton/tuned.py's table for one card from ``--sweep-mma`` rows: per "KxN" and swept row count,
    the fastest tile whose products were right, where it beat the tile of the rule (``mma_config`` without a
    table) by more than TUNED_MARGIN; the rule's time is its own row of the sweep, else the shipped path's. At
    PLANES_MAX_M rows or fewer the rule's path is the planes kernel, and a tile must beat that instead (the
    launcher then takes mma there): its own time (``planes_us``), or in sweeps made before it was timed the
    shipped path's, which was the planes kernel only where the table had no tile there yet."""
    from kernels.triton.w4a16 import PLANES_MAX_M
    from kernels.triton.w4a16_mma import KERNEL_FLAGS, mma_config

    by_case: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        if "us" in row and row["rel_error"] < 2e-3:
            by_case.setdefault((row["shape"], row["m"]), []).append(row)
    table: dict[str, dict[str, dict]] = {}
    for (label, m), timed in sorted(by_case.items()):
        k, n = BATCHED_SHAPES[label]
        rule = mma_config(m, n, k, sms)
        rule_us = next((r["us"] for r in timed if r["config"] == rule), timed[0]["shipped_us"])
        if m <= PLANES_MAX_M:
            rule_us = timed[0].get("planes_us", timed[0]["shipped_us"])
        best = min(timed, key=lambda r: r["us"])
        if best["us"] < TUNED_MARGIN * rule_us:
            keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", *KERNEL_FLAGS)
            tile = {key: best["config"][key] for key in keys if key in best["config"]}
            if best["config"]["split"] != mma_config(m, n, k, sms, tile)["split"]:  # a split other than the rule's
                tile["split"] = best["config"]["split"]
            table.setdefault(f"{k}x{n}", {})[str(m)] = tile
            print(f"tuned {label} M={m}: {rule_us:.1f} -> {best['us']:.1f} us {tile}", flush=True)
    return table


def write_tuned(path: str, device: str, table: dict, shapes: list[str] | None = None,
                rows: tuple[int, ...] | None = None) -> None:
    """Put one card's table into the tuned file (other cards' entries stay); with ``shapes`` ("KxN"), only
    those shapes' entries are replaced (or dropped where the table has none), and with ``rows`` only those row
    counts of them: a sweep split over device calls keeps what the others measured."""
    tuned = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    if shapes is None:
        tuned[device] = table
    else:
        card = tuned.setdefault(device, {})
        for shape in shapes:
            swept = table.get(shape, {})
            kept = {} if rows is None else {m: tile for m, tile in card.get(shape, {}).items() if int(m) not in rows}
            card[shape] = {**kept, **swept}
            if not card[shape]:
                del card[shape]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(tuned, indent=1, sort_keys=True) + "\n")


def write_json(path: str, date: str, copy_bw: float, results: list[Result], extra: list[Result]) -> None:
    doc = {
        "card": torch.cuda.get_device_name(),
        "date": date,
        "command": "python3 bench/kernels.py " + " ".join(sys.argv[1:]),
        "copy_bandwidth_GBps": round(copy_bw, 1),
        "results": [r.row() for r in results],
        "info": [r.row() for r in extra],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/kernels.json")
    parser.add_argument("--sweep", default=None, help="also time config variants and write them here")
    parser.add_argument("--sweep-mma", default=None, help="also time the 17-256-row kernel's tiles, written here")
    parser.add_argument("--mma-shapes", default="", help="--sweep-mma only on shapes whose names hold one of these "
                                                         "comma-separated parts (e.g. 8B)")
    parser.add_argument("--mma-rows", default=",".join(map(str, MMA_SWEEP_ROWS)),
                        help="--sweep-mma only at these comma-separated row counts (the table's other rows stay)")
    parser.add_argument("--tuned-out", default=None,
                        help="with --sweep-mma or --tuned-from: write the card's fastest tiles into this table "
                             "(kernels/triton/tuned/w4a16_mma.json)")
    parser.add_argument("--tuned-from", default=None,
                        help="make the table from an earlier --sweep-mma file (no GPU needed; give --device-name "
                             "and --sms of the card it ran on)")
    parser.add_argument("--device-name", default=None)
    parser.add_argument("--sms", type=int, default=None)
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--only", default="small,decode,prefill,w4a16,batched", help="comma-separated sections")
    parser.add_argument("--ncu", default=None, help="K,N,M: only launch the default W4A16 path 30 times (for ncu)")
    args = parser.parse_args()
    if args.tuned_from:
        if not (args.tuned_out and args.device_name and args.sms):
            parser.error("--tuned-from needs --tuned-out, --device-name and --sms")
        rows = json.loads(Path(args.tuned_from).read_text())["w4a16_mma"]
        write_tuned(args.tuned_out, args.device_name, tuned_table(rows, args.sms))
        return
    if args.ncu:
        k, n, m = (int(v) for v in args.ncu.split(","))
        x = torch.randn(m, k, dtype=DTYPE, device=DEV)
        weights = random_int4(k, n)
        for _ in range(30):
            triton_ops.w4a16_matmul(x, *weights, GROUP)
        torch.cuda.synchronize()
        return
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"card {torch.cuda.get_device_name()}  copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    results: list[Result] = []
    extra: list[Result] = []
    sections = {
        "small": lambda: bench_small_ops(copy_bw, results),
        "decode": lambda: bench_decode(copy_bw, results, extra),
        "decode1": lambda: bench_decode_single_stream(extra),
        "decodeN": lambda: bench_decode_batched(copy_bw, extra),
        "prefill": lambda: bench_prefill(results, extra),
        "w4a16": lambda: bench_w4a16(copy_bw, results, extra),
        "batched": lambda: bench_w4a16_batched(results, extra),
    }
    for name in filter(None, args.only.split(",")):
        try:
            sections[name]()
        except Exception:  # noqa: BLE001 (report the section as failed, run the rest)
            traceback.print_exc()
            results.append(Result(f"{name}: FAILED", float("nan"), "", "runs", False))
        torch.cuda.empty_cache()
        write_json(args.out, args.date, copy_bw, results, extra)  # partial results survive a timeout
        print(f"[{name} done]", flush=True)
    if args.sweep:
        sweep(copy_bw, args.sweep)
    if args.sweep_mma:
        sweep_mma(args.sweep_mma, args.tuned_out, args.mma_shapes, tuple(map(int, args.mma_rows.split(","))))
    for r in extra:
        print(f"  {r.name:<70} {r.value:>10.3f} {r.unit}")
    print(f"\n{'target':<72} {'value':>9} {'unit':<10} {'target':<8} pass")
    for r in results:
        print(f"{r.name:<72} {r.value:>9.3f} {r.unit:<10} {r.target:<8} {r.passed}")
    passed = sum(bool(r.passed) for r in results)
    print(f"\n{passed}/{len(results)} targets met; copy bandwidth {copy_bw:.0f} GB/s")


if __name__ == "__main__":
    main()
