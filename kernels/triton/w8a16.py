"""W8A16 matmul for the optional int8 LM head: y = (x @ qweight^T) * row_scales, qweight [N, K] int8.

Why: a quantized model's LM head is the checkpoint's fp16 matrix, the largest single weight a decode step reads
(Llama-3-8B: 128,256 x 4,096, 1.05 of the 4.70 GB a token; llama.cpp's Q4_0 files keep it at Q6_K). The int8
head (``EngineArgs.lm_head_quantization``) halves those bytes. At one row the fused decode step reads it
through the dense GEMV (kernels/triton/dense_gemv.py, ``row_scales``); every other step's sampled rows
(batched decode, the last token of a prefill) come here.

Each program owns a [BLOCK_M, BLOCK_N] tile of the output: K steps of x [BLOCK_M, BLOCK_K] (fp16 or bf16) and
of the weight [BLOCK_N, BLOCK_K] int8, converted to x's dtype in registers (exact: |q| <= 127) and fed to
``tl.dot`` with an fp32 accumulator; the row scales are applied once, after the K loop. The programs of one
weight tile are adjacent in the grid (the M tiles vary fastest), so that a tile the first reads from HBM is
still in L2 for the others and the head streams about once whatever M is (the intent; not yet timed on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import cdiv, interpreting, next_pow2


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # x [M, K] @ w [N, K]^T * scale [N] -> out [M, N]; grid = (M tiles, N tiles)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]  # [BM, BK]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [BK, BN]: the weight's rows as columns
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_live = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_live[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_live[:, None] & n_mask[None, :], other=0, eviction_policy="evict_first")
        acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(scale_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


MANY_ROW_TILES = [  # candidates for 64-256 rows, timed beside the rule by bench/gemv.py --dense (the rule took 587
    # us on the 8B head at 128 rows against cuBLAS's fp16 376, H100, session 33): one M tile of 128 rows over 8
    # warps reads the weight once. All compile for sm_90 without spills, in <= 160 KB of shared memory
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
]


def w8a16_config(m: int, k: int) -> dict:
    """Tile of a launch: 16-64 rows of x (``tl.dot``'s least is 16; past 64 rows the M tiles share the weight
    tile through L2), 64 weight rows and 128 of K a step; not swept on a GPU yet."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 1}
    return {"BLOCK_M": min(64, max(16, next_pow2(m))), "BLOCK_N": 64, "BLOCK_K": min(128, max(16, next_pow2(k))),
            "num_warps": 4, "num_stages": 3}


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, row_scales: torch.Tensor,
                 config: dict | None = None) -> torch.Tensor:
    """x [M, K] fp16/bf16 @ (qweight [N, K] int8 * row_scales [N])^T -> [M, N] in x's dtype. ``config``: a tile
    in place of ``w8a16_config``'s (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), for timing others."""
    if x.dim() != 2 or qweight.dim() != 2 or qweight.shape[1] != x.shape[1] or row_scales.shape != qweight.shape[:1]:
        raise ValueError(f"w8a16_matmul: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, row_scales "
                         f"{tuple(row_scales.shape)} disagree (qweight [N, K], row_scales [N])")
    if qweight.dtype != torch.int8 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"w8a16_matmul: needs an int8 weight and fp16/bf16 x (got {qweight.dtype}, {x.dtype})")
    m, k = x.shape
    n = qweight.shape[0]
    x = x.contiguous()
    qweight = qweight.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = dict(config) if config is not None else w8a16_config(m, k)
    tiles = {name: cfg.pop(name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    grid = (cdiv(m, tiles["BLOCK_M"]), cdiv(n, tiles["BLOCK_N"]))
    _w8a16_kernel[grid](x, qweight, row_scales, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0),
                        **tiles, **cfg)
    return out
