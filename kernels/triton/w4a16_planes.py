"""W4A16 matmul by nibble planes on tensor cores: the packed words never leave the thread that loaded them.

Why (BENCHMARKS.md, Kernels): the earlier GEMV kernels spent 10-14 instructions per weight (x reloads, address
math, an unpack per nibble, converts), so they ran at the issue rate, not at memory bandwidth. Here:
- The packed tile qw [BLOCK_K // 8, BLOCK_N] is the B operand of 8 small dots, one per nibble j ("plane" j:
  row 8b + w of the plane is input row 64b + 8j + w, kernels/reference.py), so the tile is converted to the
  tensor-core layout once, as int32, and every nibble is unpacked in the registers that hold it.
- Byte b of two packed rows becomes two fp16x2 registers with one PRMT and two LOP3 (``_unpack_byte``): the
  nibble ORed into the mantissa of 1024 (even nibble: 1024 + code; odd nibble, masked in place: 1024 + 16 *
  code, its x plane pre-divided by 16, exact). bf16 uses 128 + code and one shift more.
- The magic offset leaves each unpacked pair in the same registers (one half2 subtraction, exact), and the zero
  point comes out per group and row of x, not per weight: sum_k x_k (c_k - z) s = (acc - z sum_k x) * s, acc
  the fp32 tensor-core sum of x c (fp16 products are exact in fp32) and sum_k x taken by the tensor cores too,
  as dots of the x planes with a constant tile of ones (each column the row's sum). Taken in registers, the
  row sums of 8 planes were 24 shuffles and ~75 converts and adds a K step, and the offsets' correction
  cancelled terms 1024 times the result.
- x is loaded as its 8 plane tiles [BLOCK_M, BLOCK_K // 8] (plane j: input rows 64b + 8j + w), each thread
  taking its operand's pairs from memory; they and the group's scales and zeros (from HBM) are loaded one K
  step ahead (cp.async stages only the packed tile, and these loads were on the critical path of every step).
  One contiguous tile permuted into packed order in registers measured 1.1-1.5x slower (a shared-memory pass);
  either is slower than the row-order layout's split of a contiguous tile at 8-16 rows (BENCHMARKS.md, issue
  16, session 15).
- Split-K partials are reduced in the same launch (kernels/triton/split_k.py): the last program to arrive for a
  tile sums the partials and writes the output.

Every K step lies in one quantization group (BLOCK_K divides the group size); group sizes that are not a
multiple of 128 and fp32 activations use the older kernels in w4a16.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.split_k import LOCK_PERIOD, last_to_arrive, lock_buffer, rearm, split_k, sum_partials


@triton.jit
def _codes_byte(qw, B: tl.constexpr, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """``_unpack_byte`` (no SHIFT_ODD) less the magic offset, in the same registers: nibble 2B's code and nibble
    2B+1's code times 16 in fp16 (bf16: the codes), exact. The offset goes with a constant, so the pair stays in
    the tensor-core operand's registers; a subtraction of anything loaded (the zero point) there sent the tile
    through shared memory (compiled for sm_90: 16 stores, 8 loads and barriers a K step)."""
    if USE_ASM and DTYPE == tl.float16:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 t, a, b, m; prmt.b32 t, $2, $3, %d; mov.b32 m, 0x64006400; "  # noqa: UP031
            "lop3.b32 a, t, 0x000F000F, 0x64006400, 0xEA; lop3.b32 b, t, 0x00F000F0, 0x64006400, 0xEA; "
            "sub.f16x2 $0, a, m; sub.f16x2 $1, b, m; }" % (0x4400 + B * 0x1111),
            constraints="=r,=r,r,r", args=[qw], dtype=(tl.float16, tl.float16), is_pure=True, pack=2,
        )
    elif USE_ASM:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 t, u, a, b, m; prmt.b32 t, $2, $3, %d; shr.b32 u, t, 4; mov.b32 m, 0x43004300; "  # noqa: UP031
            "lop3.b32 a, t, 0x000F000F, 0x43004300, 0xEA; lop3.b32 b, u, 0x000F000F, 0x43004300, 0xEA; "
            "sub.rn.bf16x2 $0, a, m; sub.rn.bf16x2 $1, b, m; }" % (0x4400 + B * 0x1111),
            constraints="=r,=r,r,r", args=[qw], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
        )
    return _byte_codes(qw, B, DTYPE, False)  # the interpreter: the same values by conversion


@triton.jit
def _unpack_byte(qw, B: tl.constexpr, DTYPE: tl.constexpr, USE_ASM: tl.constexpr, SHIFT_ODD: tl.constexpr = False):
    """Byte B of every packed word -> (lo, hi) in DTYPE: fp16 (1024 + nibble 2B, and for nibble 2B+1 either
    1024 + 16 * nibble, masked in place, its x plane pre-divided by 16, or with ``SHIFT_ODD`` 1024 + nibble, one
    shift more), bf16 (128 + nibble 2B, 128 + nibble 2B+1). Elementwise; the asm handles two words per PRMT and
    leaves each pair in one 32-bit register, as the tensor-core operand wants it."""
    if USE_ASM:
        # prmt: byte B of the first word -> byte 0, byte B of the second word -> byte 2 (selector 0x4400 + B * 0x1111)
        if DTYPE == tl.float16 and not SHIFT_ODD:
            lo, hi = tl.inline_asm_elementwise(
                asm="{ .reg .b32 t; prmt.b32 t, $2, $3, %d; "  # noqa: UP031 (constexpr)
                "lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $1, t, 0x00F000F0, 0x64006400, 0xEA; }"
                % (0x4400 + B * 0x1111),
                constraints="=r,=r,r,r", args=[qw], dtype=(tl.float16, tl.float16), is_pure=True, pack=2,
            )
        elif DTYPE == tl.float16:
            lo, hi = tl.inline_asm_elementwise(
                asm="{ .reg .b32 t, u; prmt.b32 t, $2, $3, %d; shr.b32 u, t, 4; "  # noqa: UP031 (constexpr)
                "lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $1, u, 0x000F000F, 0x64006400, 0xEA; }"
                % (0x4400 + B * 0x1111),
                constraints="=r,=r,r,r", args=[qw], dtype=(tl.float16, tl.float16), is_pure=True, pack=2,
            )
        else:
            lo, hi = tl.inline_asm_elementwise(
                asm="{ .reg .b32 t, u; prmt.b32 t, $2, $3, %d; shr.b32 u, t, 4; "  # noqa: UP031 (constexpr)
                "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $1, u, 0x000F000F, 0x43004300, 0xEA; }"
                % (0x4400 + B * 0x1111),
                constraints="=r,=r,r,r", args=[qw], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
            )
    else:  # the interpreter has no inline asm (nor a bf16 bitcast): the same values by conversion
        magic: tl.constexpr = 1024.0 if DTYPE == tl.float16 else 128.0
        lo, hi = _byte_codes(qw, B, DTYPE, SHIFT_ODD)
        lo = lo + magic
        hi = hi + magic
    return lo, hi


@triton.jit
def _byte_codes(qw, B: tl.constexpr, DTYPE: tl.constexpr, SHIFT_ODD: tl.constexpr):
    # the interpreter's unpack of byte B: nibble 2B's code, and nibble 2B+1's (times 16 in place for fp16
    # without SHIFT_ODD), as DTYPE
    t = qw >> (8 * B)
    lo = (t & 0xF).to(DTYPE)
    if DTYPE == tl.float16 and not SHIFT_ODD:
        hi = (t & 0xF0).to(DTYPE)
    else:
        hi = ((t >> 4) & 0xF).to(DTYPE)
    return lo, hi


@triton.jit
def _x_cols(perm_ptr, cols, HAS_PERM: tl.constexpr, live):
    # input rows (columns of x) to read for weight rows ``cols``: perm[cols] under GPTQ act-order
    if HAS_PERM:
        return tl.load(perm_ptr + cols, mask=live, other=0).to(tl.int32)
    return cols


@triton.jit
def _plane_rows(k0, rr, j):
    # input rows met by nibble j of a K step's packed rows rr (0 .. BLOCK_K // 8 - 1) from row k0 (a multiple of
    # 64): 64b + 8j + w for rr = 8b + w, the packed layout of kernels/reference.py
    return k0 + (rr // 8) * 64 + 8 * j + rr % 8


@triton.jit
def _x_plane(x_rows, perm_ptr, k0, k_end, rr, j: tl.constexpr, m_mask, HAS_PERM: tl.constexpr):
    # plane j of the x tile, [BLOCK_M, BLOCK_K // 8]: column 8b + w is input row k0 + 64b + 8j + w
    # (``_plane_rows``). Loaded as its own tile, each thread takes its tensor-core operand's pairs
    # straight from memory; one contiguous tile split into planes in registers went through shared memory
    # (its permute into packed order measured 1.1-1.5x slower at 2-16 rows)
    cols = _plane_rows(k0, rr, j)
    live = cols < k_end  # (tensor masks only: the interpreter mistypes scalar-bool & tensor)
    return tl.load(x_rows + _x_cols(perm_ptr, cols, HAS_PERM, live)[None, :], mask=m_mask[:, None] & live[None, :],
                   other=0.0)


@triton.jit
def _step_operands(x_rows, scales_ptr, zeros_ptr, perm_ptr, k0, k_end, rr, rn, m_mask, n_mask, N, GROUP_SIZE,
                   HAS_PERM: tl.constexpr):
    # the 8 x planes [BLOCK_M, BLOCK_K // 8] and the fp32 scales / zeros [BLOCK_N] of the K step at k0 (zeros
    # past k_end)
    live_n = n_mask & ((k0 + rn * 0) < k_end)  # [BLOCK_N]
    g = k0 // GROUP_SIZE  # (K // G) * N stays far below 2**31
    s = tl.load(scales_ptr + g * N + rn, mask=live_n, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + g * N + rn, mask=live_n, other=0.0).to(tl.float32)
    return (_x_plane(x_rows, perm_ptr, k0, k_end, rr, 0, m_mask, HAS_PERM),
            _x_plane(x_rows, perm_ptr, k0, k_end, rr, 1, m_mask, HAS_PERM),
            _x_plane(x_rows, perm_ptr, k0, k_end, rr, 2, m_mask, HAS_PERM),
            _x_plane(x_rows, perm_ptr, k0, k_end, rr, 3, m_mask, HAS_PERM),
            _x_plane(x_rows, perm_ptr, k0, k_end, rr, 4, m_mask, HAS_PERM),
            _x_plane(x_rows, perm_ptr, k0, k_end, rr, 5, m_mask, HAS_PERM),
            _x_plane(x_rows, perm_ptr, k0, k_end, rr, 6, m_mask, HAS_PERM),
            _x_plane(x_rows, perm_ptr, k0, k_end, rr, 7, m_mask, HAS_PERM), s, z)


@triton.jit
def _planes_kernel(
    x_ptr,
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    perm_ptr,
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
    HAS_PERM: tl.constexpr,
    SERIAL: tl.constexpr,
    USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
):
    # x [M, K] @ W [K, N]; grid = (m tiles * n tiles, splits). splits == 1: out [M, N] directly; else fp32
    # partials [splits, M, N] in part_ptr, summed by the last program of each tile (SERIAL) or by a reduce kernel
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    if dtype == tl.float16:
        ODD_SCALE: tl.constexpr = 0.0625  # odd planes: 16 * code (masked in place) times x / 16
    else:
        ODD_SCALE: tl.constexpr = 1.0
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    rr = tl.arange(0, BLOCK_K // 8)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    qw_ptrs = qw_ptr + (k_start // 8 + rr).to(tl.int64)[:, None] * N + rn[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    zero_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ones = tl.full([BLOCK_K // 8, BLOCK_N], 1.0, dtype)  # constant tensor-core operands for the row sums of x
    ones_odd = tl.full([BLOCK_K // 8, BLOCK_N], 1.0 / ODD_SCALE, dtype)
    # software prefetch (one K step ahead, in registers) of what the tensor-core pipeline does not stage through
    # shared memory: the x tile, and the group's scales and zeros. Loaded at first use they put an L2 / HBM
    # round trip on every K step (measured: time followed K steps per program, not bytes). Two steps ahead
    # measured slower (more registers, fewer programs per SM): BENCHMARKS.md, Kernels.
    x0, x1, x2, x3, x4, x5, x6, x7, s, z = _step_operands(x_rows, scales_ptr, zeros_ptr, perm_ptr, k_start, k_end,
                                                          rr, rn, m_mask, n_mask, N, GROUP_SIZE, HAS_PERM)
    for k0 in range(k_start, k_end, BLOCK_K):
        qw = tl.load(qw_ptrs, mask=n_mask[None, :], other=0)  # [BLOCK_K // 8, BLOCK_N] int32
        nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, s_next, z_next = _step_operands(
            x_rows, scales_ptr, zeros_ptr, perm_ptr, k0 + BLOCK_K, k_end, rr, rn, m_mask, n_mask, N, GROUP_SIZE,
            HAS_PERM)
        if ODD_SCALE != 1.0:  # exact (powers of two); values under 2^-10 lose bits, ~1e-8 absolute
            x1 = x1 * ODD_SCALE
            x3 = x3 * ODD_SCALE
            x5 = x5 * ODD_SCALE
            x7 = x7 * ODD_SCALE
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        lo, hi = _codes_byte(qw, 0, dtype, USE_ASM)
        part = tl.dot(x0, lo, part)
        part = tl.dot(x1, hi, part)
        lo, hi = _codes_byte(qw, 1, dtype, USE_ASM)
        part = tl.dot(x2, lo, part)
        part = tl.dot(x3, hi, part)
        lo, hi = _codes_byte(qw, 2, dtype, USE_ASM)
        part = tl.dot(x4, lo, part)
        part = tl.dot(x5, hi, part)
        lo, hi = _codes_byte(qw, 3, dtype, USE_ASM)
        part = tl.dot(x6, lo, part)
        part = tl.dot(x7, hi, part)
        # part = sum_k x_k c_k; the zero point's term needs each row's sum of x (the odd planes' x / 16 times 16)
        xsum = tl.dot(x0, ones, zero_acc)
        xsum = tl.dot(x2, ones, xsum)
        xsum = tl.dot(x4, ones, xsum)
        xsum = tl.dot(x6, ones, xsum)
        xsum = tl.dot(x1, ones_odd, xsum)
        xsum = tl.dot(x3, ones_odd, xsum)
        xsum = tl.dot(x5, ones_odd, xsum)
        xsum = tl.dot(x7, ones_odd, xsum)
        acc += (part - xsum * z[None, :]) * s[None, :]
        x0, x1, x2, x3, x4, x5, x6, x7, s, z = nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, s_next, z_next
        qw_ptrs += (BLOCK_K // 8) * N
    mask = m_mask[:, None] & n_mask[None, :]
    if splits == 1:
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(dtype), mask=mask)
    else:
        tile = rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + tile, acc, mask=mask)
        if SERIAL:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if last_to_arrive(lock_ptr, pid, splits):
                total = sum_partials(part_ptr, tile, mask, splits, M * N, SPLITS)
                tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], total.to(dtype), mask=mask)
                rearm(lock_ptr, pid, lock_rest)


def planes_supported(x: torch.Tensor, group_size: int, k: int) -> bool:
    """fp16/bf16 activations and K steps of 128 rows inside one group."""
    return x.dtype in (torch.float16, torch.bfloat16) and group_size % 128 == 0 and k % 128 == 0


def planes_config(m: int, n: int, k: int, sms: int) -> dict:
    """Tile and split-K, the best of ``bench/kernels.py --sweep`` on the H200 (BENCHMARKS.md, Kernels):
    128 columns per program and split-K to ~2 programs per SM (doubled while N has fewer tiles than SMs);
    with more than 4 rows and N <= 8192, 64 columns and ~4 programs per SM. Fewer programs leave HBM latency
    exposed; more lengthen the last program's sum of the partials."""
    block_n = 64 if m > 4 and n <= 8192 else 128
    tiles = triton.cdiv(m, 16) * triton.cdiv(n, block_n)
    if block_n == 64:
        split = triton.cdiv(4 * sms, tiles)
    else:
        split = triton.cdiv(2 * sms, tiles)
        if split < 4 and tiles < sms:
            split *= 2
    split = max(1, min(split, k // 256, 64))
    return {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
            "split": split, "serial": True}


def planes_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, perm: torch.Tensor | None, out: torch.Tensor, cfg: dict,
                  interpret: bool = False) -> None:
    """Launch into ``out`` [M, N]; cfg from ``planes_config`` (BLOCK_*, num_warps, num_stages, split, serial)."""
    from kernels.triton.w4a16 import _splitk_reduce_kernel

    m, k = x.shape
    n = qweight.shape[1]
    cfg = dict(cfg)
    split, serial = cfg.pop("split"), cfg.pop("serial")
    reuse_lock = cfg.pop("reuse_lock", True)
    per, split = split_k(k, cfg["BLOCK_K"], split)
    serial = serial and split <= LOCK_PERIOD.value
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        lock = lock_buffer(qweight, tiles, reuse_lock) if serial else part
    else:
        part = lock = out  # unused
    _planes_kernel[(tiles, split)](
        x, qweight, scales, zeros, perm if perm is not None else qweight, out, part, lock,
        m, n, k, per, split, LOCK_PERIOD.value - split, x.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_PERM=perm is not None, SERIAL=bool(serial and split > 1), USE_ASM=not interpret,
        SPLITS=triton.next_power_of_2(split), **cfg,
    )
    if split > 1 and not serial:
        block = 1024 if not interpret else 256
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, out, m * n, n, split, out.stride(0), BLOCK=block, num_warps=4
        )
