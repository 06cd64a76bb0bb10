"""W4A16 matmul over packed int4 weights (AWQ/GPTQ after load-time repack): y = x @ dequant(qweight).

Layout (kernels/reference.py): qweight [K // 8, N] int32 in blocks of 64 input rows, nibble j of packed row
8b + w is input row 64b + 8j + w; scales and zeros [K // G, N] in the activation dtype; w = (code - zero) * scale;
optional ``perm`` gathers x's columns. Group sizes are 32 or multiples of 64.
Paths, picked by M (rows of x):
- M <= 16, fp16/bf16, group size a multiple of 128: ``planes`` (kernels/triton/w4a16_planes.py), the packed
  words as tensor-core operands one nibble plane at a time, split-K reduced in the same launch.
- other M <= 16 cases (group sizes 32/64, fp32 activations), ``gemv``: split-K across programs so enough of
  them stream the packed weights; at M == 1 the last program of each column tile sums the fp32 partials in
  the same launch (the separate reduce took as long as the GEMV itself on SmolLM2's small matrices: 2.7 vs
  2.9 us a call, 120 calls per token), for 2..16 rows ``_splitk_reduce_kernel`` sums them. The packed tile
  [BLOCK_K // 8, BLOCK_N] stays in registers: nibble j of every packed row meets its input rows (``J_LOOP``,
  ``_plane_rows``).
  M == 1 uses fp32 FMAs (``_gemv_m1_kernel``); 2..16 rows one 16-row ``tl.dot`` per nibble with the scale
  applied once per group after the sum.
- 16 < M <= ``MMA_MAX_M``, fp16/bf16, group size a multiple of 128: ``mma`` (kernels/triton/w4a16_mma.py), the
  product computed transposed so the dequantized weight is wgmma's register operand.
- other 16 < M < ``DEQUANT_MIN_M`` cases: tensor-core tiles; each K step unpacks a [BLOCK_K, BLOCK_N] weight
  tile in registers, dequantizes it and feeds ``tl.dot``. Autotuned over a few configs per (M bucket, N, K).
- M >= ``DEQUANT_MIN_M`` where ``mma`` does not apply: dequantize once to a dense buffer and use torch.matmul
  (cuBLAS): measured faster than the fused tiles from M = 256 up (BENCHMARKS.md, Kernels).
Codes become floats without int->float converts (``_codes_to``). A K step is whole 64-row blocks inside one
quantization group (G % BLOCK_K == 0), so a step needs one row of scales and zeros, except for G = 32: a step is
then one block of two groups, nibbles 0-3 in the first and 4-7 in the second (``GROUP32``), and each nibble
plane (or each unpacked row) takes its own group's row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import INT4_BLOCK
from kernels.triton.common import (
    autotune_disk_cache,
    cdiv,
    device_name,
    interpreting,
    largest_pow2_divisor,
    launch,
    next_pow2,
    num_sms,
)
from kernels.triton.split_k import LOCK_PERIOD, last_to_arrive, lock_buffer, rearm, split_k
from kernels.triton.tuned import tuned_tile
from kernels.triton.w4a16_mma import mma_config, mma_matmul, mma_supported
from kernels.triton.w4a16_planes import (
    _plane_rows,
    planes_config,
    planes_matmul,
    planes_supported,
)

DEQUANT_MIN_M = 128
PLANES_MAX_M = 16
# at 256 rows mma is 1.16-1.19x faster than dequantize + cuBLAS on gate/up and down, 0.94-0.96x on qkv and o:
# a layer's matmuls 7-9% faster (BENCHMARKS.md, issue 16, session 14)
MMA_MAX_M = 256
TENSOR_CORE_PATHS = {"planes": planes_matmul, "mma": mma_matmul}  # their launchers


def tensor_core_plan(path: str, x: torch.Tensor, m: int, n: int, k: int) -> dict:
    """The tile and split of a tensor-core path: for mma the tile measured fastest on this card for this
    shape where one was (kernels/triton/tuned.py), else each path's rule."""
    sms = num_sms(x.device)
    if path == "mma":
        tile = tuned_tile("w4a16_mma", device_name(x.device), k, n, m) if x.is_cuda else None
        return mma_config(m, n, k, sms, tile)
    return planes_config(m, n, k, sms)


@triton.jit
def _codes_to(codes, DTYPE: tl.constexpr):
    """Int codes 0..15 -> DTYPE without int->float converts: OR the code into the mantissa of a power of two
    (1024 in fp16, 128 in bf16, 2**23 in fp32), reinterpret the bits, subtract that power. Exact."""
    if DTYPE == tl.float16:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    elif DTYPE == tl.bfloat16:
        return (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0
    else:
        return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _load_codes(qw_ptr, k0, rn, n_mask, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # packed rows [k0 // 8, k0 // 8 + BLOCK_K // 8) x columns rn -> int codes [BLOCK_K, BLOCK_N] in input-row order
    rp = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    qw = tl.load(qw_ptr + rp.to(tl.int64)[:, None] * N + rn[None, :], mask=n_mask[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    codes = (qw[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K // 8, 8, BLOCK_N]: [8b + w, j]
    codes = tl.permute(tl.reshape(codes, (BLOCK_K // 64, 8, 8, BLOCK_N)), (0, 2, 1, 3))  # [b, j, w, n]
    return tl.reshape(codes, (BLOCK_K, BLOCK_N))  # row 64b + 8j + w


@triton.jit
def _group_params(scales_ptr, zeros_ptr, k0, rn, n_mask, N, group_size, DTYPE: tl.constexpr):
    # scale and zero rows [BLOCK_N] of the group holding input row k0
    g = (k0 // group_size).to(tl.int64)
    s = tl.load(scales_ptr + g * N + rn, mask=n_mask, other=0.0).to(DTYPE)
    z = tl.load(zeros_ptr + g * N + rn, mask=n_mask, other=0.0).to(DTYPE)
    return s, z


@triton.jit
def _row_group_params(scales_ptr, zeros_ptr, k0, rn, n_mask, N, group_size, BLOCK_K: tl.constexpr,
                      DTYPE: tl.constexpr):
    # scales and zeros [BLOCK_K, BLOCK_N] of each input row of the step at k0 (G = 32: two groups a step)
    g = ((k0 + tl.arange(0, BLOCK_K)) // group_size).to(tl.int64)[:, None] * N + rn[None, :]
    s = tl.load(scales_ptr + g, mask=n_mask[None, :], other=0.0).to(DTYPE)
    z = tl.load(zeros_ptr + g, mask=n_mask[None, :], other=0.0).to(DTYPE)
    return s, z


@triton.jit
def _dequant_tile(
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    k0,
    rn,
    n_mask,
    N,
    group_size,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DTYPE: tl.constexpr,
    GROUP32: tl.constexpr,
):
    # -> dequantized [BLOCK_K, BLOCK_N] in DTYPE, rounded like the reference: (code - zero) * scale in DTYPE
    codes = _codes_to(_load_codes(qw_ptr, k0, rn, n_mask, N, BLOCK_K, BLOCK_N), DTYPE)
    if GROUP32:
        s, z = _row_group_params(scales_ptr, zeros_ptr, k0, rn, n_mask, N, group_size, BLOCK_K, DTYPE)
        return (codes - z) * s
    s, z = _group_params(scales_ptr, zeros_ptr, k0, rn, n_mask, N, group_size, DTYPE)
    return (codes - z[None, :]) * s[None, :]


def _tc_configs() -> list[triton.Config]:
    """A few tensor-core tiles per M bucket (32, 64, 128, >= 256); ``_prune`` keeps the bucket's ones."""
    shapes = [
        (32, 64, 128, 4, 4),
        (32, 128, 128, 4, 4),
        (64, 64, 128, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 128, 128, 8, 3),
        (128, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 128, 128, 8, 3),
        (256, 128, 64, 8, 3),
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in shapes
    ]


def _prune(configs, named_args, **kwargs):
    """Keep the tiles whose BLOCK_M suits the M bucket, with BLOCK_K shrunk to divide the group size."""
    args = {**named_args, **kwargs}
    m_bucket, group = args["M_BUCKET"], args["GROUP_KEY"]
    want = {min(128, max(32, m_bucket))} | ({256} if m_bucket >= 256 else set())
    keep, seen = [], set()
    for c in configs:
        if c.kwargs["BLOCK_M"] not in want:
            continue
        bk = c.kwargs["BLOCK_K"]
        while bk > 64 and group % bk:  # whole 64-row blocks; G = 32 takes two groups a step (GROUP32)
            bk //= 2
        kw = {**c.kwargs, "BLOCK_K": bk}
        key = (tuple(sorted(kw.items())), c.num_warps, c.num_stages)
        if key not in seen:
            seen.add(key)
            keep.append(triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages))
    return keep


@triton.autotune(
    configs=_tc_configs(),
    key=["M_BUCKET", "N", "K", "GROUP_KEY", "SPLIT"],
    prune_configs_by={"early_config_prune": _prune},
    **autotune_disk_cache(),
)
@triton.jit(do_not_specialize=["M"])  # M only bounds rows: one binary for every eager step size
def _w4a16_kernel(
    x_ptr,
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    perm_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    k_per_split,
    stride_xm,
    stride_om,
    M_BUCKET,
    GROUP_KEY,
    HAS_PERM: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    J_LOOP: tl.constexpr,
    GROUP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x [M, K] @ W [K, N]; grid = (m tiles * n tiles, splits); out [M, N] or fp32 partials [splits, M, N].
    # SCALE_AFTER needs the step in one group (not GROUP32)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m  # m fastest: programs sharing a weight tile run together (L2 reuse)
    pid_n = pid // num_pid_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    dtype = x_ptr.dtype.element_ty
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    rr = tl.arange(0, BLOCK_K // 8)
    for k0 in range(k_start, k_end, BLOCK_K):
        if J_LOOP:
            # no unpack-reshape: the packed tile [BLOCK_K // 8, BLOCK_N] stays in registers and nibble j of
            # every packed row meets its input rows, one tl.dot (K = BLOCK_K // 8) per nibble; GROUP32: each
            # plane scaled by its own group (planes 0-3 and 4-7 of a block are two groups)
            rp = k0 // 8 + rr
            qw = tl.load(qw_ptr + rp.to(tl.int64)[:, None] * N + rn[None, :], mask=n_mask[None, :], other=0)
            s, z = _group_params(scales_ptr, zeros_ptr, k0, rn, n_mask, N, group_size, tl.float32)
            xc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            x_sum = tl.zeros([BLOCK_M], tl.float32)
            for j in tl.static_range(8):
                kx = _plane_rows(k0, rr, j)
                if HAS_PERM:
                    kx = tl.load(perm_ptr + kx)
                xj = tl.load(x_rows + kx[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K // 8]
                c = _codes_to((qw >> (4 * j)) & 0xF, dtype)  # [BLOCK_K // 8, BLOCK_N]
                if GROUP32:
                    s, z = _group_params(scales_ptr, zeros_ptr, k0 + 8 * j, rn, n_mask, N, group_size, tl.float32)
                    part = tl.dot(xj, c)
                    acc += (part - tl.sum(xj.to(tl.float32), axis=1)[:, None] * z[None, :]) * s[None, :]
                else:
                    xc = tl.dot(xj, c, xc)
                    x_sum += tl.sum(xj.to(tl.float32), axis=1)
            if not GROUP32:
                acc += (xc - x_sum[:, None] * z[None, :]) * s[None, :]
        else:
            rk = k0 + tl.arange(0, BLOCK_K)
            if HAS_PERM:
                rk = tl.load(perm_ptr + rk)
            x = tl.load(x_rows + rk[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            if SCALE_AFTER:
                # the K step lies in one group, so x @ ((c - z) * s) = (x @ c - rowsum(x) * z) * s per column:
                # the weight tile needs no arithmetic beyond its exact conversion (cheap when BLOCK_M << BLOCK_K)
                c = _codes_to(_load_codes(qw_ptr, k0, rn, n_mask, N, BLOCK_K, BLOCK_N), dtype)
                s, z = _group_params(scales_ptr, zeros_ptr, k0, rn, n_mask, N, group_size, tl.float32)
                xc = tl.dot(x, c)  # [BLOCK_M, BLOCK_N] fp32, exact products of small integers
                x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
                acc += (xc - x_sum[:, None] * z[None, :]) * s[None, :]
            else:
                w = _dequant_tile(
                    qw_ptr, scales_ptr, zeros_ptr, k0, rn, n_mask, N, group_size, BLOCK_K, BLOCK_N, dtype, GROUP32
                )
                acc = tl.dot(x, w, acc)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        dst = out_ptr + (pid_k * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
        tl.store(dst, acc, mask=mask)
    else:
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(dtype), mask=mask)


@triton.jit
def _gemv_m1_kernel(
    x_ptr,
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    perm_ptr,
    out_ptr,
    final_ptr,
    lock_ptr,
    N,
    K,
    group_size,
    k_per_split,
    splits,
    lock_rest,
    HAS_PERM: tl.constexpr,
    SPLIT: tl.constexpr,
    SERIAL: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    GROUP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x [1, K] @ W [K, N] without tensor cores, fp32 FMAs into a [BLOCK_K, BLOCK_N] register tile.
    # GROUP32: each nibble plane takes its own group's scales (SCALE_AFTER needs one group a step)
    # SPLIT: out is fp32 partials [splits, N]; SERIAL: the last program of a column tile to finish sums them
    # into final [N] (arrival counters as in w4a16_planes.py), so no second kernel runs
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    rr = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
    y = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        # packed tile [BLOCK_K // 8, BLOCK_N] stays in registers; nibble j meets input rows _plane_rows(k0, rr, j)
        rp = k0 // 8 + rr
        qw = tl.load(qw_ptr + rp.to(tl.int64)[:, None] * N + rn[None, :], mask=n_mask[None, :], other=0)
        s, z = _group_params(scales_ptr, zeros_ptr, k0, rn, n_mask, N, group_size, tl.float32)
        xc = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
        x_sum = tl.zeros([BLOCK_K // 8], tl.float32)
        for j in tl.static_range(8):
            kx = _plane_rows(k0, rr, j)
            if GROUP32:
                s, z = _group_params(scales_ptr, zeros_ptr, k0 + 8 * j, rn, n_mask, N, group_size, tl.float32)
            if HAS_PERM:
                kx = tl.load(perm_ptr + kx)
            xj = tl.load(x_ptr + kx).to(tl.float32)  # [BLOCK_K // 8]
            c = _codes_to((qw >> (4 * j)) & 0xF, tl.float32)  # [BLOCK_K // 8, BLOCK_N]
            if SCALE_AFTER:
                xc += xj[:, None] * c
                x_sum += xj
            else:
                acc += xj[:, None] * ((c - z[None, :]) * s[None, :])
        if SCALE_AFTER:  # per group: (sum_k x c - z sum_k x) * s
            y += (tl.sum(xc, axis=0) - tl.sum(x_sum, axis=0) * z) * s
    if not SCALE_AFTER:
        y = tl.sum(acc, axis=0)  # [BLOCK_N]
    if SPLIT:
        tl.store(out_ptr + pid_k.to(tl.int64) * N + rn, y, mask=n_mask)
        if SERIAL:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if last_to_arrive(lock_ptr, pid_n, splits):
                total = tl.zeros([BLOCK_N], tl.float32)
                for sk in range(splits):
                    total += tl.load(out_ptr + sk * N + rn, mask=n_mask, other=0.0, cache_modifier=".cg")
                tl.store(final_ptr + rn, total.to(x_ptr.dtype.element_ty), mask=n_mask)
                rearm(lock_ptr, pid_n, lock_rest)
    else:
        tl.store(out_ptr + rn, y.to(x_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, out_ptr, MN, N, splits, stride_om, BLOCK: tl.constexpr):
    # fp32 partials [splits, M, N] -> out [M, N] (row stride stride_om)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + (offs // N) * stride_om + offs % N, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(
    qw_ptr, scales_ptr, zeros_ptr, w_ptr, N, group_size, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    # packed [K // 8, N] -> dense [K, N] in w's dtype; grid = (K // BLOCK_K, cdiv(N, BLOCK_N))
    k0 = tl.program_id(0) * BLOCK_K
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    dtype = w_ptr.dtype.element_ty
    rr = tl.arange(0, BLOCK_K // 8)
    qw = tl.load(
        qw_ptr + (k0 // 8 + rr).to(tl.int64)[:, None] * N + rn[None, :], mask=n_mask[None, :], other=0
    )
    for j in tl.static_range(8):
        s, z = _group_params(scales_ptr, zeros_ptr, k0 + 8 * j, rn, n_mask, N, group_size, dtype)  # G = 32: 2 a step
        w = (_codes_to((qw >> (4 * j)) & 0xF, dtype) - z[None, :]) * s[None, :]
        rows = _plane_rows(k0, rr, j).to(tl.int64)
        tl.store(w_ptr + rows[:, None] * N + rn[None, :], w, mask=n_mask[None, :])


def _k_unit(group_size: int) -> int:
    """Largest power of two <= 128 dividing the group size, at least one 64-row block: every BLOCK_K divides it,
    and splits cover whole units, so each K step stays inside one group (G = 32: one block of two groups)."""
    return max(INT4_BLOCK, largest_pow2_divisor(group_size, 128))


def gemv_config(m: int, n: int, k: int, group_size: int, sms: int) -> dict:
    """Tile, warps and split-K for M <= 16: many short programs so enough weight loads are in flight."""
    if interpreting():
        return {
            "kernel": "m1" if m == 1 else "dot",
            "BLOCK_N": 16,
            "BLOCK_K": INT4_BLOCK,
            "num_warps": 1,
            "num_stages": 1,
            "split": max(1, min(2, k // INT4_BLOCK)),
        }
    block_k = _k_unit(group_size)
    block_n = 64 if m == 1 or n <= 8192 else 128
    kernel = "m1" if m == 1 else "dot"
    # Measured (BENCHMARKS.md): time tracks K steps per program, not bytes, so each program takes about
    # two K steps; the fp32 partials (split x M x N, summed by a second small kernel) are capped near a
    # quarter of the packed weight bytes as M grows.
    split = max(1, min(k // (2 * block_k), max(2, k // (32 * m)), 64))
    return {
        "kernel": kernel,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "num_warps": 4,
        "num_stages": 4,
        "split": split,
    }


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    # qweight [K // 8, N] int32 -> dense [K, N] in scales' dtype
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty((k, n), dtype=scales.dtype, device=qweight.device)
    block_k = INT4_BLOCK if interpreting() else _k_unit(group_size)
    block_n = 32 if interpreting() else 64
    _dequant_kernel[(k // block_k, cdiv(n, block_n))](
        qweight, scales, zeros, w, n, group_size, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4
    )
    return w


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
    path: str | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    # x: [M, K] fp16/bf16; qweight: [K // 8, N] int32; scales, zeros: [K // G, N]; perm: [K] -> y [M, N]
    # path: None picks by M; "planes", "mma", "gemv", "tc" or "dequant" force one; config: a planes, mma or
    # gemv tile (both for benchmarks)
    m, k = x.shape
    n = qweight.shape[1]
    group_size = k if group_size <= 0 else group_size
    if qweight.shape[0] * 8 != k or scales.shape != (k // group_size, n) or zeros.shape != scales.shape:
        raise ValueError(
            f"w4a16_matmul: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
            f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}, group {group_size} disagree"
        )
    if k % group_size or k % INT4_BLOCK or (group_size % INT4_BLOCK and group_size != 32):
        raise ValueError(f"w4a16_matmul: K={k} must be a multiple of {INT4_BLOCK} and of the group size "
                         f"{group_size}, which must be 32 or a multiple of {INT4_BLOCK}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"w4a16_matmul: unsupported activation dtype {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    scales = scales.to(x.dtype).contiguous()
    zeros = zeros.to(x.dtype).contiguous()
    qweight = qweight.contiguous()
    if path is None:
        path = _pick_path(x, m, k, group_size, n)
    if path == "dequant":
        xp = x if perm is None else x[:, perm]
        return torch.matmul(xp, dequantize(qweight, scales, zeros, group_size))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    sms = num_sms(x.device)
    if path in TENSOR_CORE_PATHS:
        cfg = dict(config or tensor_core_plan(path, x, m, n, k))
        if interpreting():
            cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 32), num_warps=4, num_stages=1)
        TENSOR_CORE_PATHS[path](x, qweight, scales, zeros, group_size, perm, out, cfg, interpret=interpreting())
        return out
    args = (qweight, scales, zeros, perm if perm is not None else qweight)
    if path == "gemv":
        split = _gemv(
            x,
            args,
            out,
            m,
            n,
            k,
            group_size,
            perm is not None,
            dict(config or gemv_config(m, n, k, group_size, sms)),
        )
    else:
        split = _tc(x, args, out, m, n, k, group_size, perm is not None, sms)
    if split is not None:
        parts, splits = split
        block = 1024 if not interpreting() else 256
        _splitk_reduce_kernel[(cdiv(m * n, block),)](
            parts, out, m * n, n, splits, out.stride(0), BLOCK=block, num_warps=4
        )
    return out


def _pick_path(x: torch.Tensor, m: int, k: int, group_size: int, n: int) -> str:
    """planes (tensor-core nibble planes) for M <= PLANES_MAX_M and mma up to MMA_MAX_M where they apply, else
    the older paths; at M <= PLANES_MAX_M mma where this card's table has a tile for the shape there (the sweep
    enters one only where it beat the planes path: bench/kernels.py ``tuned_table``)."""
    if m <= PLANES_MAX_M and planes_supported(x, group_size, k):
        if x.is_cuda and mma_supported(x, group_size, k) and tuned_tile("w4a16_mma", device_name(x.device), k, n, m):
            return "mma"
        return "planes"
    if m <= 16:
        return "gemv"
    if m <= MMA_MAX_M and mma_supported(x, group_size, k):
        return "mma"
    return "dequant" if m >= DEQUANT_MIN_M and not interpreting() else "tc"


def _gemv(x, args, out, m, n, k, group_size, has_perm, cfg):
    """M <= 16: returns (fp32 partials, splits) when split-K needs a reduce, else None."""
    kind, split = cfg.pop("kernel"), cfg.pop("split")
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], _k_unit(group_size))
    group32 = group_size < cfg["BLOCK_K"]  # a step of one 64-row block holds two 32-row groups
    k_per_split, split = split_k(k, _k_unit(group_size), split)
    dst = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    if kind == "m1" and m == 1:
        tiles = cdiv(n, cfg["BLOCK_N"])
        cfg["SCALE_AFTER"] = cfg.get("SCALE_AFTER", False) and not group32
        serial = cfg.pop("serial", True) and 1 < split <= LOCK_PERIOD.value
        lock = lock_buffer(args[0], tiles, reuse=True) if serial else dst
        _gemv_m1_kernel[(tiles, split)](
            x, *args, dst, out, lock, n, k, group_size, k_per_split, split, LOCK_PERIOD.value - split,
            HAS_PERM=has_perm, SPLIT=split > 1, SERIAL=serial, GROUP32=group32, **cfg
        )
        if serial:
            return None
    else:
        cfg.setdefault("BLOCK_M", 16)
        cfg["SCALE_AFTER"] = cfg.get("SCALE_AFTER", True) and not group32
        cfg.setdefault("J_LOOP", cfg["BLOCK_K"] >= 128 or interpreting())  # tl.dot needs K >= 16 on GPUs
        grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), split)
        launch(
            _w4a16_kernel,
            grid,
            x,
            *args,
            dst,
            m,
            n,
            k,
            group_size,
            k_per_split,
            x.stride(0),
            out.stride(0),
            16,
            group_size,
            HAS_PERM=has_perm,
            SPLIT=split > 1,
            GROUP32=group32,
            config=cfg,
        )
    return (dst, split) if split > 1 else None


def _tc(x, args, out, m, n, k, group_size, has_perm, sms):
    """M > 16: autotuned tensor-core tiles; split-K only while the M x N tiles cannot fill the GPU."""
    m_bucket = min(256, next_pow2(m))
    tiles = cdiv(m, min(m_bucket, 128)) * cdiv(n, 128)
    split = max(1, min(cdiv(sms, tiles), 8)) if m <= 64 else 1
    k_per_split, split = split_k(k, _k_unit(group_size), split)
    dst = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), split)

    fixed = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": INT4_BLOCK, "num_warps": 4} if interpreting() else None
    launch(
        _w4a16_kernel,
        grid,
        x,
        *args,
        dst,
        m,
        n,
        k,
        group_size,
        k_per_split,
        x.stride(0),
        out.stride(0),
        m_bucket,
        group_size,
        HAS_PERM=has_perm,
        SPLIT=split > 1,
        SCALE_AFTER=False,
        J_LOOP=False,
        GROUP32=group_size == 32,
        config=fixed,
    )
    return (dst, split) if split > 1 else None
