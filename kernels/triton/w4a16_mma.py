"""W4A16 matmul for 17-256 rows on tensor cores, the weight tile as the left operand in registers.

Why (BENCHMARKS.md, issue 16): at 32-128 rows the fused tiles of w4a16.py ran at 0.40-0.75x of fp16 cuBLAS.
They put the dequantized weight in the right operand, which Hopper's wgmma reads from shared memory, so every
weight went register -> shared -> tensor core after its unpack. Here the product is computed transposed,
out^T [N, M] = W^T [N, K] @ x^T [K, M]: the weight is the left operand, which wgmma may take from registers.

- A K step is 128 input rows: the packed tile [BLOCK_N, 16 words], two blocks of the load-time layout of
  kernels/reference.py (nibble j of word 8b + w is input row 64b + 8j + w). Byte B of two words becomes nibble
  planes 2B and 2B + 1 as fp16x2 / bf16x2 registers with one PRMT, a shift and two LOP3 (w4a16_planes.py's
  ``_unpack_byte``: the nibble ORed into the mantissa of 1024, or 128 in bf16); then (v - (1024 + zero)) *
  scale, exact up to the one rounding of the reference's (code - zero) * scale.
- The packed tile is copied by TMA (a tensor descriptor). Loaded through pointers, Triton rematerialized the load
  in the operand's layout, as 8 four-byte cp.async copies a thread a step with their 64-bit address arithmetic;
  TMA copied the box in hardware, 1.1-1.3x faster at 16-64 rows (BENCHMARKS.md, issue 16, session 15). The x
  tile stays a pointer load: by TMA too it was faster still but gave NaN at 128-row tiles with split-K.
- The 8 planes are joined back into input-row order (``_dequant_step``), so x is read as it is, one
  [128, BLOCK_M] tile a step that Triton stages through shared memory, and the step is ONE ``tl.dot``: Triton
  keeps its 8 wgmmas in flight into the next step. One dot per plane measured 1.1-1.7x slower at 32-128 rows
  (each dot waited for the previous one), even with x pre-permuted into plane order (which cost 3-9 us a call).
- Split-K only while the M x N tiles leave SMs idle; the partials are summed by the last program to arrive
  (kernels/triton/split_k.py).

Every K step lies in one quantization group (group sizes are multiples of 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.triton.split_k import LOCK_PERIOD, last_to_arrive, lock_buffer, rearm, split_k, sum_partials
from kernels.triton.w4a16_planes import _unpack_byte

K_STEP = 128  # input rows per K step: 16 packed words of 8 nibble planes
KERNEL_FLAGS = ("X_TMA", "WARP_SPECIALIZE")  # a tile's optional switches (off unless the tuned table sets them)


@triton.jit
def _dequant_step(qw, s, zm, DTYPE: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed tile qw [BLOCK_N, 16] int32 (two 64-row blocks) -> W^T [BLOCK_N, 128] in DTYPE, column 64b + 8j + w
    from nibble j of word 8b + w; ``s`` the scales, ``zm`` MAGIC + zero [BLOCK_N].

    The permute below moves no data: wgmma's register operand gives lane q of a quad the columns 2q, 2q + 1,
    2q + 8 and 2q + 9 of every 16, which in this layout are all 8 nibbles of words 2q and 2q + 1 of each
    block, so each thread unpacks exactly the words it loaded (the row-order layout needed a shuffle of the
    dequantized tile through shared memory: ~80 of 392 instructions a step, BENCHMARKS.md issue 16)."""
    p0, p1 = _unpack_byte(qw, 0, DTYPE, USE_ASM, SHIFT_ODD=True)  # planes 0 and 1 as MAGIC + code
    p2, p3 = _unpack_byte(qw, 1, DTYPE, USE_ASM, SHIFT_ODD=True)
    p4, p5 = _unpack_byte(qw, 2, DTYPE, USE_ASM, SHIFT_ODD=True)
    p6, p7 = _unpack_byte(qw, 3, DTYPE, USE_ASM, SHIFT_ODD=True)
    # joined innermost-last: [n, word, j2, j1, j0] holds plane j = 4 j2 + 2 j1 + j0 of each word
    planes = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))
    planes = tl.reshape(planes, [BLOCK_N, 2, 8, 2, 2, 2])  # [n, block b, word w, j2, j1, j0]
    planes = tl.permute(planes, (0, 1, 3, 4, 5, 2))  # [n, b, j2, j1, j0, w]: column 64b + 8j + w
    w = tl.reshape(planes, [BLOCK_N, 128])
    return (w - zm[:, None]) * s[:, None]


@triton.jit
def _sum_rows_apart(part_ptr, out_ptr, rn, n_mask, pid_m, M, N, splits, stride_om, BLOCK_M: tl.constexpr,
                    SPLITS: tl.constexpr):
    # a 256-row tile's split-K total written SUM_ROWS rows of x at a time: its whole [BLOCK_N, BLOCK_M] sum beside
    # the splits' loaded partials took 255 registers and spilled (compiled for sm_90); at 64 rows 204-222 up to 4
    # splits, fewer rows at once for more splits (the loads of every split are in flight together)
    SUM_ROWS: tl.constexpr = 256 // max(SPLITS, 4)
    for first in tl.static_range(0, BLOCK_M, SUM_ROWS):
        rows = (pid_m * BLOCK_M + first + tl.arange(0, SUM_ROWS)).to(tl.int64)
        live = n_mask[:, None] & (rows < M)[None, :]
        total = sum_partials(part_ptr, rn[:, None] + rows[None, :] * N, live, splits, M * N, SPLITS)
        out = out_ptr + rn[:, None] + rows[None, :] * stride_om
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _mma_kernel(
    x_src,
    qw_desc,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    part_ptr,
    lock_ptr,
    M,
    N,
    K,
    k_per_split,
    splits,
    lock_rest,
    stride_xm,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    X_TMA: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    # x [M, K] @ W [K, N] -> out [M, N]; grid = (m tiles * n tiles, splits). The accumulator is out^T
    # [BLOCK_N, BLOCK_M]. splits > 1: fp32 partials [splits, M, N], summed by the tile's last program.
    # x_src: x's pointer, or with X_TMA a tensor descriptor of [BLOCK_M, 128] boxes (copied by TMA: no address
    # arithmetic a step; rows past M come as zeros). WARP_SPECIALIZE: Triton splits the K loop into a
    # loading and a computing partition. Both are tiles for the sweep to try (bench/kernels.py --sweep-mma):
    # x by TMA once gave NaN at 128-row tiles with split-K, and neither is chosen unless the tuned table
    # (kernels/triton/tuned.py) measured it right and faster.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m  # m fastest: the programs reading one weight tile run together (L2 reuse)
    pid_n = pid // num_pid_m
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if dtype == tl.float16:
        MAGIC: tl.constexpr = 1024.0
    else:
        MAGIC: tl.constexpr = 128.0
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if not X_TMA:  # (with TMA the descriptor is indexed by the step)
        x_ptrs = x_src + rm.to(tl.int64)[None, :] * stride_xm + (k_start + tl.arange(0, 128))[:, None]  # [128, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(k_start, k_end, 128, warp_specialize=WARP_SPECIALIZE):
        qw = tl.trans(qw_desc.load([k0 // 8, pid_n * BLOCK_N]))  # [BLOCK_N, 16] int32, zeros past N
        g = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + g * N + rn, mask=n_mask, other=0.0)
        zm = tl.load(zeros_ptr + g * N + rn, mask=n_mask, other=0.0) + MAGIC  # exact: small integers
        if X_TMA:
            x = tl.trans(x_src.load([pid_m * BLOCK_M, k0]))  # [128, BLOCK_M]
        else:
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            x_ptrs += 128
        acc = tl.dot(_dequant_step(qw, s, zm, dtype, USE_ASM, BLOCK_N), x, acc)
    out_tile = rn[:, None] + rm.to(tl.int64)[None, :] * stride_om  # [BLOCK_N, BLOCK_M]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLITS == 1:  # (a compile-time branch: the split-K code, atomics included, kept Triton from warp-specializing)
        tl.store(out_ptr + out_tile, acc.to(dtype), mask=mask)
    else:
        tile = rn[:, None] + rm.to(tl.int64)[None, :] * N
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + tile, acc, mask=mask)
        if last_to_arrive(lock_ptr, pid, splits):
            if BLOCK_M <= 128:
                total = sum_partials(part_ptr, tile, mask, splits, M * N, SPLITS)
                tl.store(out_ptr + out_tile, total.to(dtype), mask=mask)
            else:
                _sum_rows_apart(part_ptr, out_ptr, rn, n_mask, pid_m, M, N, splits, stride_om, BLOCK_M, SPLITS)
            rearm(lock_ptr, pid, lock_rest)


def mma_supported(x: torch.Tensor, group_size: int, k: int) -> bool:
    """fp16/bf16 activations and K steps of 128 rows inside one group."""
    return x.dtype in (torch.float16, torch.bfloat16) and group_size % K_STEP == 0 and k % K_STEP == 0


def mma_config(m: int, n: int, k: int, sms: int, tile: dict | None = None) -> dict:
    """Tile and split-K. ``tile`` (BLOCK_M as a cap, BLOCK_N, num_warps, num_stages, optionally the split) is
    one measured fastest for this shape and row bucket on this card (kernels/triton/tuned.py); without one, the
    best of sweeps at 32-256
    rows on the H200 (BENCHMARKS.md, issue 16, session 14): BLOCK_M covers the rows up to 128; 64 weight
    columns, 4 warps and 3 stages, unless those tiles need more than one wave (3 programs an SM fit at
    BLOCK_M <= 64, 2 above: registers and shared memory); then 128 columns with 8 warps (8B gate/up at 64 rows:
    69.8 us in 448 narrow tiles, 56.1 in 224 wide ones; 7B gate/up, 344 tiles in one wave: 45.2 narrow, 56.0
    wide). Split-K while the tiles leave SMs idle (a program an SM; a tuned tile's split may ask for more, as
    few tiles at 17-64 rows leave most of an SM's program slots empty), each split at least 4 K steps."""
    rows = max(16, triton.next_power_of_2(m))
    if tile is None:
        block_m = min(128, rows)
        per_sm = 3 if block_m <= 64 else 2
        wide = triton.cdiv(m, block_m) * triton.cdiv(n, 64) > per_sm * sms
        tile = {"BLOCK_M": block_m, "BLOCK_N": 128 if wide else 64, "num_warps": 8 if wide else 4,
                "num_stages": 3}
    block_m = min(tile["BLOCK_M"], rows)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, tile["BLOCK_N"])
    split = tile.get("split") or triton.cdiv(sms, tiles)  # a measured split, else the tiles fill the SMs once
    split = max(1, min(split, k // (4 * K_STEP), 16))
    flags = {key: tile[key] for key in KERNEL_FLAGS if tile.get(key)}
    if flags.get("WARP_SPECIALIZE"):
        split = 1  # Triton splits the loop only where the kernel is compiled without its split-K path
    return {"BLOCK_M": block_m, "BLOCK_N": tile["BLOCK_N"], "num_warps": tile["num_warps"],
            "num_stages": tile["num_stages"], "split": split, **flags}


def mma_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, perm: torch.Tensor | None, out: torch.Tensor, cfg: dict,
               interpret: bool = False) -> None:
    """Launch into ``out`` [M, N]; cfg from ``mma_config`` (BLOCK_M, BLOCK_N, num_warps, num_stages, split, and
    optionally X_TMA / WARP_SPECIALIZE). GPTQ's act-order ``perm`` gathers x's columns first (one pass over x)."""
    m, k = x.shape
    n = qweight.shape[1]
    cfg = dict(cfg)
    per, split = split_k(k, K_STEP, cfg.pop("split"))
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        lock = lock_buffer(qweight, tiles, reuse=True)
    else:
        part = lock = out  # unused
    if perm is not None:
        x = x[:, perm]
    qw_desc = TensorDescriptor.from_tensor(qweight, [16, cfg["BLOCK_N"]])  # one K step's packed tile
    x_src = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], K_STEP]) if cfg.get("X_TMA") else x
    _mma_kernel[(tiles, split)](
        x_src, qw_desc, scales, zeros, out, part, lock, m, n, k, per, split, LOCK_PERIOD.value - split,
        x.stride(0), out.stride(0), GROUP_SIZE=group_size, USE_ASM=not interpret,
        SPLITS=triton.next_power_of_2(split), **cfg,
    )
