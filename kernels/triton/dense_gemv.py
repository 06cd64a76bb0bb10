"""fp16 GEMV at M = 1 for dense weights, with the decode layer's neighbours fused (single-stream decode, issue 15).

Why: an fp16 model's decode step is one row of x against every weight, bound by how fast two bytes a weight
stream from HBM. Through cuBLAS the layer's other ops stay launches of their own (RMSNorm, rotary, the cache
write, SiLU: ten launches a layer, where the fused int4 layer has five), and its one-row matmuls are not what
cuBLAS tunes for; issue 15 measured the fp16 7B step at 0.62 of the bandwidth roofline (llama.cpp 0.72). Here
the product of a column tile is this kernel's own part and the rest is the one-row GEMVs' shared tail
(kernels/triton/gemv_epilogue.py: the norm's 1 / rms, split-K, the residual add, SiLU x up, rotary + the cache
write), so an fp16 model's layer is the same five launches as an int4 one's, and the final norm rides on the
LM head's launch.

- The weight is the Linear's own [N, K] (out, in), read in place: a program's tile is ``BLOCK_N`` output rows
  by ``BLOCK_K`` of K, each thread loading 16 contiguous bytes (8 weights) of every row of the tile a step, the
  warps side by side along K, so x's slice of a step is one 16-byte load a thread already in the products'
  layout. The products accumulate elementwise in fp32 [BLOCK_N, BLOCK_K] (fp16 x fp16 is exact in fp32) and K
  is reduced once, after the loop.
- The loop takes ~4.5 SASS instructions a weight (144 for a thread's 32 a step), about a third of an SM's issue
  rate at the H200's bandwidth, against ~20 a 4-byte word of int4 (w4a16_gemv.py), so it is bound by memory
  latency, not issue: what it needs is bytes in flight. Each program loads its next K step while it multiplies
  this one, and the grid is sized to ~24 warps an SM with split-K (``dense_gemv_plan``).
- A rotary tile holds whole rotary pairs (rows d and d + head_dim / 2 of a head), all the tail's ROPE epilogue
  needs; with Qwen3's per-head q/k norms it holds a whole head.
- With the RMSNorm prologue the dot reads x times the norm weight (formed here in fp16, or read as the previous
  launch's ``normed``), and the tail scales the sum by 1 / rms, as the int4 GEMV does.
- An int8 weight with a scale per row (``row_scales``: the optional int8 LM head, ``Int8Rows``) takes the same
  loop at 16 weights a thread a step (still one 16-byte load a row). A code becomes fp32 without the
  conversion unit: added to the bits of 1.5 * 2^23 and that float subtracted (an integer add and an FADD,
  exact for |q| < 2^22), where the H200's bandwidth in int8 weights would need about the 16 conversions a
  cycle an SM has. The row's scale multiplies its sum once, before the tail. Compiled for sm_90 (8B head,
  final norm): 159 registers, no spills, 5.8 SASS instructions a weight, and x through shared memory (its
  8-element runs do not match the weights' 16): ~0.6 of an SM's issue rate at the H100's bandwidth, ~0.85 at
  the H200's, so on an H200 it may be issue-bound (not yet timed). A DP2A dot over the x16 planes
  (w4a16_gemv.py's) with the head's bytes reordered to the planes' rows would take ~0.6 a weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton.common import (
    cdiv,
    gdc_launch_dependents,
    gdc_wait,
    interpreting,
    maxnreg_option,
    next_pow2,
    num_sms,
    warps_an_sm_holds,
)
from kernels.triton.gemv_epilogue import (
    MAX_SPLIT,
    ROPE,
    dot_input,
    epilogue_launch,
    finish_tile,
    rope_position,
)
from kernels.triton.split_k import split_k


INT8_MAGIC: tl.constexpr = tl.constexpr(0x4B400000)  # the bits of 1.5 * 2^23
INT8_MAGIC_FLOAT: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def _weights_f32(w, INT8: tl.constexpr):
    # a step's weights [BN, BK] in fp32: fp16 converted, or int8 codes q as float(bits(1.5 * 2^23) + q) - 1.5 * 2^23
    # (exact: the sum stays within the float's 23-bit mantissa), no int-to-float conversion
    if INT8:
        return (w.to(tl.int32) + INT8_MAGIC).to(tl.float32, bitcast=True) - INT8_MAGIC_FLOAT
    else:
        return w.to(tl.float32)


@triton.jit
def _dense_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    squares_ptr,
    lock_ptr,
    norm_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    bias_ptr,
    normed_ptr,
    next_norm_ptr,
    normed_out_ptr,
    x16_out_ptr,
    N,
    K,
    k_per_split,
    splits,
    lock_rest,
    eps,
    qk_eps,
    stride_wn,
    row_scale_ptr,
    NORM: tl.constexpr,
    EPILOGUE: tl.constexpr,
    USE_PDL: tl.constexpr,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLITS: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    PRESCALED: tl.constexpr,
    NEXT_NORM: tl.constexpr,
    X16_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_SCALES: tl.constexpr,
):
    # x [K] @ W^T, W [N, K] (row stride stride_wn); grid = (column tiles, splits); fp32 partials [splits, N] in
    # part_ptr. PRESCALED (with NORM): the dot reads x * norm weight from normed_ptr (the previous launch's
    # NEXT_NORM output) and x gives only the rms. ROW_SCALES: W is int8 codes and row n's product is scaled by
    # row_scale_ptr[n]
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if EPILOGUE == ROPE and not QK_NORM:  # rotary pairs: row i is column d (+ HEAD_DIM / 2 in the second half)
        HALF: tl.constexpr = HEAD_DIM // 2
        i = tl.arange(0, BLOCK_N)
        pair = pid_n * (BLOCK_N // 2) + i % (BLOCK_N // 2)  # d of head h as h * HALF + d
        rn = pair // HALF * HEAD_DIM + pair % HALF + i // (BLOCK_N // 2) * HALF
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    # masks past the split's end are per 16 bytes: K is a multiple of 8 (16 for int8), and a mask that is
    # constant over each thread's 8 (16) contiguous weights lets them load as one 16-byte access (per column, it
    # split them into 4-byte loads: SASS, session 18)
    CHUNK: tl.constexpr = 16 if ROW_SCALES else 8
    rk_chunk = rk // CHUNK * CHUNK
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_start + rk)[None, :]  # [BN, BK], a step at a time
    # the first step's weights are loaded before waiting on the previous kernel (programmatic dependent launch):
    # they do not depend on it, so their HBM latency overlaps its tail
    w = tl.load(w_ptrs, mask=n_mask[:, None] & (k_start + rk_chunk < k_end)[None, :], other=0,
                eviction_policy="evict_first")
    pos, slot = rope_position(pos_ptr, slot_ptr, EPILOGUE)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    MUL_NORM: tl.constexpr = NORM and not PRESCALED  # the dot multiplies x by the norm weight itself
    dot_ptr, x_slice = dot_input(x_ptr, normed_ptr, k_start, k_end, NORM, PRESCALED, EPILOGUE, SPLITS, NORM_BLOCK)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w_ptrs += BLOCK_K
        live_next = (k0 + BLOCK_K + rk_chunk) < k_end
        w_next = tl.load(w_ptrs, mask=n_mask[:, None] & live_next[None, :], other=0, eviction_policy="evict_first")
        live = (k0 + rk_chunk) < k_end
        x = tl.load(dot_ptr + k0 + rk, mask=live, other=0.0)  # [BK] fp16
        if MUL_NORM:  # rounded to fp16, as the int4 GEMV's half2 multiply rounds it
            x = x * tl.load(norm_ptr + k0 + rk, mask=live, other=0.0)
        acc += _weights_f32(w, ROW_SCALES) * x.to(tl.float32)[None, :]
        w = w_next
    y = tl.sum(acc, axis=1)  # [BN]; with NORM, still to be scaled by 1 / rms(x)
    if ROW_SCALES:
        y *= tl.load(row_scale_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    finish_tile(y, x_slice, pid_n, pid_k, x_ptr, out_ptr, part_ptr, squares_ptr, lock_ptr, cos_sin_ptr, pos, slot,
                k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr, bias_ptr, next_norm_ptr, normed_out_ptr, x16_out_ptr, rn, n_mask, N,
                K,
                splits, lock_rest, eps, qk_eps, NORM, EPILOGUE, Q_SIZE, KV_SIZE, HEAD_DIM, QK_NORM, HAS_BIAS, SPLITS,
                NORM_BLOCK, NEXT_NORM, X16_OUT, BLOCK_N, 0)  # rotary partners through memory


@dataclass(frozen=True)
class DenseGemvPlan:
    """Tile and split-K of one dense GEMV launch: ``block_n`` output rows by ``block_k`` of K a step."""

    block_n: int
    block_k: int
    split: int
    num_warps: int
    max_registers: int | None = None  # ptxas's cap (Triton's maxnreg); None: ptxas chooses


ROWS_PER_THREAD = 4  # a tile's rows: every thread holds all of them, 8 weights of each a step (4 x 16 B in flight)
WARPS = 4
HEAD_TILE_WEIGHTS = 32  # weights a thread a step where a tile must hold whole heads (Qwen3's q/k norms)
# uncapped, the four-warp tiles compile to 66-80 registers (sm_90): 6-7 programs an SM; at 64, 8 (the residual
# launches do not spill there, the norm ones do)
UNCAPPED_PROGRAMS_PER_SM = 6
ONE_WAVE_REGISTERS = 64
ONE_WAVE_PROGRAMS_PER_SM = warps_an_sm_holds(ONE_WAVE_REGISTERS) // WARPS  # 8


def dense_gemv_plan(n: int, k: int, sms: int, head_dim: int | None = None, warps_per_sm: int = 24,
                    norm: bool = False, one_wave: bool = True, element_size: int = 2) -> DenseGemvPlan:
    """Column tile, K step and split-K. A tile is ``ROWS_PER_THREAD`` rows (a ROPE launch's: two rotary pairs),
    each thread holding 8 contiguous weights of every row and the warps side by side along K: a K step is
    8 x 32 x ``WARPS`` = 1,024 columns (capped at K's power of two), and x's slice of a step is one 16-byte load
    a thread in the layout the products need. Tiles of rows across the warps made Triton pass x through shared
    memory every step (two barriers a step, SASS, session 18). ``head_dim`` (a ROPE launch with Qwen3's q/k
    norms, which normalize whole heads): the tile is a head, 8 warps, ``HEAD_TILE_WEIGHTS`` weights a thread a
    step. The split gives ~``warps_per_sm`` warps an SM, at most ``MAX_SPLIT`` and one K step a split. A grid
    the SMs hold in one wave only at ``ONE_WAVE_REGISTERS`` gets that cap (``one_wave``; not with an RMSNorm
    prologue, ``norm``, whose launches spill there): the 7B o and down are 1,024 programs, 924 resident at 66
    registers on 132 SMs, and the 100 left over ran their whole K loop (11 steps on down) in the launch's tail at
    one program an SM; at 64 registers 1,056 fit. Larger grids are many waves of short programs either way.
    ``element_size`` 1 (an int8 weight): 16 weights a thread a step, the same 16 bytes, with no cap (its
    accumulators are twice the fp16 tile's: 64 fp32 a thread)."""
    per_load = 16 // element_size  # weights in a thread's 16-byte load of a row
    if head_dim is not None:
        block_n, warps = head_dim, 8
        block_k = HEAD_TILE_WEIGHTS * 32 * warps // head_dim
    else:
        block_n, warps = ROWS_PER_THREAD, WARPS
        block_k = per_load * 32 * warps
    if interpreting():
        return DenseGemvPlan(block_n, 32, max(1, min(2, cdiv(k, 32))), 1)
    block_k = min(block_k, next_pow2(k))
    split = max(1, min(cdiv(k, block_k), cdiv(warps_per_sm * sms, cdiv(n, block_n) * warps), MAX_SPLIT))
    programs = cdiv(n, block_n) * split
    capped = (one_wave and not norm and warps == WARPS and element_size == 2
              and UNCAPPED_PROGRAMS_PER_SM * sms < programs <= ONE_WAVE_PROGRAMS_PER_SM * sms)
    return DenseGemvPlan(block_n, block_k, split, warps, ONE_WAVE_REGISTERS if capped else None)


def dense_weight_unsupported(weight: torch.Tensor, row_scales: torch.Tensor | None = None) -> str | None:
    """Why the dense GEMV cannot read ``weight`` (None when it can): it needs an fp16 [N, K] with contiguous
    rows and K a multiple of 8 (the loop's masks are per 16 bytes), or with ``row_scales`` [N] an int8 one with
    K a multiple of 16. The fused decode layer asks this at load."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        return f"a weight of shape {tuple(weight.shape)} without contiguous rows"
    if row_scales is not None:
        if weight.dtype != torch.int8 or weight.shape[1] % 16 or row_scales.shape != weight.shape[:1]:
            return (f"an int8 weight of {weight.dtype}, in_features {weight.shape[1]}, row scales "
                    f"{tuple(row_scales.shape)} (needs int8, a multiple of 16, a scale a row)")
        return None
    if weight.dtype != torch.float16 or weight.shape[1] % 8:
        return f"a dense weight of {weight.dtype}, in_features {weight.shape[1]} (needs fp16, a multiple of 8)"
    return None


def dense_gemv_supported(x: torch.Tensor, weight: torch.Tensor, row_scales: torch.Tensor | None = None) -> bool:
    """One fp16 row against a weight ``dense_weight_unsupported`` accepts."""
    return x.dtype == torch.float16 and x.shape[0] == 1 and dense_weight_unsupported(weight, row_scales) is None


def dense_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    normed: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    next_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    silu: bool = False,
    rope: dict | None = None,
    bias: torch.Tensor | None = None,
    row_scales: torch.Tensor | None = None,
    plan: DenseGemvPlan | None = None,
) -> torch.Tensor:
    """y = x @ weight^T for one row, with optional fused neighbours: x [1, K] fp16, weight [N, K] fp16 (rows
    contiguous), or int8 codes with ``row_scales`` [N] (y = (x @ weight^T) * row_scales); the fusions are
    ``w4a16_gemv``'s (kernels/triton/w4a16_gemv.py) and return what it returns."""
    k = x.shape[1]
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"dense_gemv: weight {tuple(weight.shape)} is not [N, {k}]")
    if not dense_gemv_supported(x, weight, row_scales):
        raise ValueError(f"dense_gemv: needs one fp16 row (x {tuple(x.shape)} {x.dtype}) and a weight the kernel "
                         f"reads ({dense_weight_unsupported(weight, row_scales) or 'it does'})")
    x = x.contiguous()
    whole_heads = rope is not None and rope.get("q_norm") is not None  # else rope tiles are rotary pairs
    plan = plan or dense_gemv_plan(n, k, num_sms(x.device), rope["head_dim"] if whole_heads else None,
                                   norm=norm_weight is not None, element_size=weight.element_size())
    k_per_split, splits = split_k(k, plan.block_k, plan.split)
    launch = epilogue_launch("dense_gemv", x, weight, n, plan.block_n, k_per_split, splits, norm_weight=norm_weight,
                             eps=eps, normed=normed, residual=residual, next_norm=next_norm, silu=silu, rope=rope,
                             bias=bias, rope_pairs=not whole_heads)
    _dense_gemv_kernel[(cdiv(n, plan.block_n), splits)](
        x, weight, *launch.args, weight.stride(0), row_scales if row_scales is not None else weight,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, ROW_SCALES=row_scales is not None,
        num_warps=plan.num_warps, **launch.constexprs,
        **maxnreg_option(plan.max_registers),
    )
    return launch.out
