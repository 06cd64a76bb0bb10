"""Diagnostic (GPU only): fused W4A16 tensor-core tiles at M = 64..256 against the shipped paths and fp16.

``python3 bench/w4a16_fused_tiles.py`` prints, per 7B shape and M, the time of fp16 ``torch.matmul``, the shipped
autotuned ``tc`` tiles, the shipped ``dequant`` path (dequantize + cuBLAS) and the four best of a fused variant
kept here (not shipped: it measured slower) in three forms: nibble planes unpacked outermost so the
[8, BLOCK_K / 8, BLOCK_N] -> [BLOCK_K, BLOCK_N] reshape keeps registers in place with x gathered to match
("outer"), planes innermost as the shipped kernel does ("inner"), and x permuted once per call ("perm"); plus
split-K over fp32 atomics for N = 4096. It is the measurement behind keeping the dequant path for M >= 128
(BENCHMARKS.md, the 128-request target). Timing: CUDA-graph replays over input sets larger than the L2.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels import GROUP, W4A16_SHAPES, bench_graph, random_int4, sets_for
from kernels.triton import w4a16 as w4a16_mod
from kernels.triton.w4a16 import _codes_to, dequantize


@triton.jit
def _tc_concat_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_om, k_per_split,
                      GROUP_SIZE: tl.constexpr, X_PERMUTED: tl.constexpr, PLANES_OUTER: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    dtype = x_ptr.dtype.element_ty
    KP: tl.constexpr = BLOCK_K // 8
    i = tl.arange(0, BLOCK_K)
    if X_PERMUTED:
        xcol = i
    elif PLANES_OUTER:
        xcol = 8 * (i % KP) + i // KP
    else:
        xcol = i
    rr = tl.arange(0, KP)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + xcol[None, :]
    qw_ptrs = qw_ptr + rr[:, None] * N + rn[None, :]
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        qw = tl.load(qw_ptrs + (k0 // 8) * N, mask=n_mask[None, :], other=0)
        if PLANES_OUTER:
            codes = (qw[None, :, :] >> shifts[:, None, None]) & 0xF  # [8, KP, BN]: row j*KP + r = k 8r + j
        else:
            codes = (qw[:, None, :] >> shifts[None, :, None]) & 0xF  # [KP, 8, BN]: row 8r + j
        c = _codes_to(tl.reshape(codes, (BLOCK_K, BLOCK_N)), dtype)
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * N + rn, mask=n_mask, other=0.0)
        z = tl.load(z_ptr + g * N + rn, mask=n_mask, other=0.0)
        w = (c - z[None, :]) * s[None, :]
        acc = tl.dot(x, w, acc)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.atomic_add(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(dtype), mask=mask)


def block_perm(k: int, block_k: int, device) -> torch.Tensor:
    """Column order of x that matches the "outer" plane order: position j * BLOCK_K / 8 + r <- input 8r + j."""
    kp = block_k // 8
    i = torch.arange(block_k, device=device)
    within = 8 * (i % kp) + i // kp
    return (torch.arange(0, k, block_k, device=device)[:, None] + within[None, :]).reshape(-1)


def concat(x, qw, s, z, cfg, planes_outer=True, perm=None, split=1):
    """y = x @ dequant(qw) with the variant kernel; cfg = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    m, k = x.shape
    n = qw.shape[1]
    bm, bn, bk, warps, stages = cfg
    if perm is not None:
        x = x.index_select(1, perm)
    if split > 1:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    _tc_concat_kernel[grid](x, qw, s, z, out, m, n, k, x.stride(0), out.stride(0), k // split,
                            GROUP_SIZE=GROUP, X_PERMUTED=perm is not None, PLANES_OUTER=planes_outer,
                            SPLIT=split > 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                            num_stages=stages)
    return out.to(x.dtype) if split > 1 else out


CONFIGS = [
    (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3), (128, 64, 128, 4, 4), (64, 64, 128, 4, 4), (32, 128, 128, 4, 4),
]


def main() -> None:
    torch.manual_seed(0)
    for label, (k, n) in W4A16_SHAPES.items():
        if label.startswith("4096x6144"):
            continue
        packed = [random_int4(k, n) for _ in range(sets_for(k * n // 2))]
        dense = [torch.randn(k, n, dtype=torch.float16, device="cuda") for _ in range(sets_for(2 * k * n))]
        for m in [64, 128, 256]:
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            qw, s, z = packed[0]
            ref = x @ dequantize(qw, s, z, GROUP)
            t_h = bench_graph([partial(torch.matmul, x, w) for w in dense])
            row = {"fp16": t_h}
            for path in ("tc", "dequant"):
                row[path] = bench_graph([partial(w4a16_mod.w4a16_matmul, x, *p, GROUP, path=path) for p in packed])
            best = (1e9, None)
            for cfg in CONFIGS:
                if cfg[0] > max(32, m) * 2:
                    continue
                for variant in ("outer", "inner", "perm") + (("outer-split2", "outer-split4") if n <= 4096 else ()):
                    kw = {}
                    if variant == "inner":
                        kw["planes_outer"] = False
                    if variant == "perm":
                        kw["perm"] = block_perm(k, cfg[2], x.device)
                    if variant.startswith("outer-split"):
                        kw["split"] = int(variant[-1])
                    try:
                        got = concat(x, qw, s, z, cfg, **kw)
                        err = (got.float() - ref.float()).abs().max().item()
                        if err > 0.05 * ref.float().abs().max().item():
                            print(f"  BAD {label} M={m} {cfg} {variant}: err {err}")
                            continue
                        t = bench_graph([partial(concat, x, *p, cfg, **kw) for p in packed])
                    except Exception as exc:  # noqa: BLE001
                        print(f"  FAIL {label} M={m} {cfg} {variant}: {type(exc).__name__} {str(exc)[:100]}")
                        continue
                    if t < best[0]:
                        best = (t, (cfg, variant))
                    row[f"{variant}{cfg}"] = t
            top = sorted((v, key) for key, v in row.items() if key not in ("fp16", "tc", "dequant"))[:4]
            print(f"{label} M={m}: fp16 {t_h*1e3:.1f} us | tc {row['tc']*1e3:.1f} ({row['tc']/t_h:.2f}x) | "
                  f"dequant {row['dequant']*1e3:.1f} ({row['dequant']/t_h:.2f}x) | best "
                  + ", ".join(f"{key} {v*1e3:.1f} ({v/t_h:.2f}x)" for v, key in top), flush=True)


if __name__ == "__main__":
    main()
