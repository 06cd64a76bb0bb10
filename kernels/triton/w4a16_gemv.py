"""W4A16 GEMV at M = 1 on CUDA cores, with the decode layer's neighbours fused into its prologue and epilogue.

Why: a single-stream decode step is one row of x against every weight of the model, so the matmul is bound by
how fast the packed weights stream from HBM, and a small model by launches (~1.3 us each inside a graph on
Hopper). The tensor-core paths (w4a16_planes.py) pad M = 1 to 16 rows and pass the packed tile through shared
memory; here each thread keeps its 16-byte loads of packed words in registers and does the whole dot product
in packed half2 arithmetic:

- word -> 4 half2 registers (four LOP3s and one shift: the nibbles ORed into the mantissa of 1024, the odd
  ones in place as 1024 + 16 code), taken to ``code - zero`` (exact, small integers) by a subtraction or an FMA
  by 1/16, times the x pairs (x[64b + 8j + w], x[64b + 8j + 32 + w]) of packed row 8b + w (kernels/reference.py's
  layout: nibble j is input row 64b + 8j + w) in fp16 FMAs: one fp32 partial per word, scaled per group in fp32.
  The halves of a half2 are rows 32 apart, so at group size 32 (SmolLM2's AWQ) each half is a group of its own:
  the word's two halves are summed apart and each scaled by its group's scale. Zero points must be integers
  (every AWQ/GPTQ checkpoint's are; ``PackedInt4.zeros_are_integers``).
- A large matrix's tile is 128 columns a warp: each thread holds 4 adjacent columns of a packed row (one 16-byte
  load), so each row's x pairs serve 4 words (22.4 SASS instructions a word, ``bench/gemv_sass.py``; 23.6 at
  group size 32, whose K step, one 64-row block, has one scale row per half).
- Split-K sized from the SM count; the last program to arrive for a column tile sums the partials and runs the
  epilogue (kernels/triton/split_k.py: no second kernel, no memset, CUDA-graph safe).
- Activations: x is read as 32-bit words (two fp16 each) and each packed row's four pairs are a byte permute
  (PRMT) of two words each: x[64b + 8j + w] is half w % 2 of word 32b + 4j + w // 2, so rows w and w + 1 of a
  block share their 8 words. Gathering the pairs element by element cost ~60 of the ~86
  instructions a packed word took (SASS of the main loop), so the loop was issue-bound, not memory-bound.
- The RMSNorm prologue's 1 / rms, the split-K partials and the fused epilogues (residual add, SiLU x up,
  rotary + KV-cache write) are the one-row GEMVs' shared tail (kernels/triton/gemv_epilogue.py); this kernel's
  part is the product of its column tile, with x times the norm weight in half2 where the prologue has a norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton.common import (
    cdiv,
    device_name,
    gdc_launch_dependents,
    gdc_wait,
    interpreting,
    largest_pow2_divisor,
    maxnreg_option,
    next_pow2,
    num_sms,
    warps_an_sm_holds,
)
from kernels.triton.gemv_epilogue import (
    MAX_SPLIT,
    check_x16_planes,
    dot_input,
    epilogue_launch,
    finish_tile,
    rope_position,
)
from kernels.triton.split_k import split_k
from kernels.triton.tuned import tuned_tile
from kernels.triton.w4a16_planes import _plane_rows


def _word_dot_ptx(halves: bool, words: int = 1) -> str:
    """The PTX of ``_word_dot``: ``words`` packed words (of one column, from different rows) times their x pairs
    in one half2 sum, then its fp32 sum, or with ``halves`` the sums of the half2's low and high halves apart (two
    outputs, so the inputs start at $2). Inputs: the words, then each word's four x pairs, then zz and zm."""
    first = 2 if halves else 1
    qs = [f"${first + i}" for i in range(words)]
    xs = [[f"${first + words + 4 * i + j}" for j in range(4)] for i in range(words)]
    zz, zm = f"${first + 5 * words}", f"${first + 5 * words + 1}"
    lines = [".reg .b32 a, b, c, d, t, acc, sixteenth;", ".reg .b16 lo, hi;"]
    lines += [] if halves else [".reg .f32 flo, fhi;"]
    lines += ["mov.b32 sixteenth, 0x2C002C00;"]
    for i, (q, (x04, x15, x26, x37)) in enumerate(zip(qs, xs)):
        lines += [
            f"lop3.b32 a, {q}, 0x000F000F, 0x64006400, 0xEA;",
            f"lop3.b32 b, {q}, 0x00F000F0, 0x64006400, 0xEA;",
            f"shr.u32 t, {q}, 8;",
            "lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;",
            "lop3.b32 d, t, 0x00F000F0, 0x64006400, 0xEA;",
            f"sub.f16x2 a, a, {zz};",
            f"fma.rn.f16x2 b, b, sixteenth, {zm};",
            f"sub.f16x2 c, c, {zz};",
            f"fma.rn.f16x2 d, d, sixteenth, {zm};",
            f"mul.rn.f16x2 acc, a, {x04};" if i == 0 else f"fma.rn.f16x2 acc, a, {x04}, acc;",
            f"fma.rn.f16x2 acc, b, {x15}, acc;",
            f"fma.rn.f16x2 acc, c, {x26}, acc;",
            f"fma.rn.f16x2 acc, d, {x37}, acc;",
        ]
    lines += ["mov.b32 {lo, hi}, acc;"]
    if halves:
        lines += ["cvt.f32.f16 $0, lo;", "cvt.f32.f16 $1, hi;"]
    else:
        lines += ["cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 $0, flo, fhi;"]
    return "{\n" + "".join(f"            {line}\n" for line in lines) + "            }"


_WORD_DOT_PTX: tl.constexpr = tl.constexpr(_word_dot_ptx(halves=False))
_WORD_DOT_HALVES_PTX: tl.constexpr = tl.constexpr(_word_dot_ptx(halves=True))
_TWO_WORDS_DOT_PTX: tl.constexpr = tl.constexpr(_word_dot_ptx(halves=False, words=2))


@triton.jit
def _two_words_dot(qa, qb, xa04, xa15, xa26, xa37, xb04, xb15, xb26, xb37, zz, zm):
    """``_word_dot`` of two words of each column (rows of one group) in one half2 sum: one fp32 conversion and
    add for 16 products instead of 8, which the issue-bound loop feels (SASS instructions a word: BENCHMARKS.md
    issue 15, session 17). Each half then sums 8 products in fp16, not 4: a little more rounding, well inside
    the output's own (same section). GPU only (inline PTX)."""
    return tl.inline_asm_elementwise(
        asm=_TWO_WORDS_DOT_PTX, constraints="=r" + ",r" * 12,
        args=[qa, qb, xa04, xa15, xa26, xa37, xb04, xb15, xb26, xb37, zz, zm], dtype=tl.float32, is_pure=True,
        pack=1)


@triton.jit
def _row_halves(t, R: tl.constexpr, BN: tl.constexpr):
    """Rows 0..R/2-1 and R/2..R-1 of ``t`` [R, BN], apart (a large matrix's rows sit in one thread, so this moves
    no data)."""
    return tl.split(tl.permute(tl.reshape(t, [2, R // 2, BN]), (1, 2, 0)))


@triton.jit
def _word_dot(qw, x04, x15, x26, x37, zz, zm, TWO_GROUPS: tl.constexpr, USE_ASM: tl.constexpr):
    """sum_j x_j * (code_j - zero) over the 8 nibbles of each packed word, in fp32; with TWO_GROUPS the sums of
    its low nibbles (0-3) and its high ones (4-7) apart, as a tuple.

    qw: packed words [R, BN] int32; x04 .. x37: half2 pairs (x of nibble j low, x of nibble j + 4 high), j = 0..3,
    as int32 [R, 1]; zz: half2 (1024 + zero) and zm: half2 -(64 + zero), as int32 [R or 1, BN], each half the
    zero of its nibbles' rows.
    Nibbles j and j + 4 (j even) land in a half2 as 1024 + code with one LOP3; nibbles j + 1 and j + 5 are taken
    in place, 16 x code, as 1024 + 16 code, and one FMA by 1/16 takes them to code - zero: 8 codes need one
    shift (Marlin's trick), not three. Nibbles j and j + 4 are input rows 32 apart (kernels/reference.py), so at
    group size 32 the two halves of every half2 are two groups, each to be scaled by its own group's scale:
    TWO_GROUPS then returns the halves unsummed."""
    if USE_ASM and TWO_GROUPS:
        return tl.inline_asm_elementwise(
            asm=_WORD_DOT_HALVES_PTX, constraints="=r,=r,r,r,r,r,r,r,r", args=[qw, x04, x15, x26, x37, zz, zm],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )
    elif USE_ASM:
        return tl.inline_asm_elementwise(
            asm=_WORD_DOT_PTX, constraints="=r,r,r,r,r,r,r,r", args=[qw, x04, x15, x26, x37, zz, zm],
            dtype=tl.float32, is_pure=True, pack=1,
        )
    else:  # the interpreter has no inline asm: the same sums in fp32
        z_lo = (zz & 0xF).to(tl.float32)
        z_hi = ((zz >> 16) & 0xF).to(tl.float32)
        low = tl.zeros(qw.shape, tl.float32)
        high = tl.zeros(qw.shape, tl.float32)
        for j in tl.static_range(4):
            if j == 0:
                pair = x04
            elif j == 1:
                pair = x15
            elif j == 2:
                pair = x26
            else:
                pair = x37
            x_lo = _half_to_f32(pair & 0xFFFF)
            x_hi = _half_to_f32((pair >> 16) & 0xFFFF)
            c_lo = ((qw >> (4 * j)) & 0xF).to(tl.float32)
            c_hi = ((qw >> (4 * j + 16)) & 0xF).to(tl.float32)
            low += x_lo * (c_lo - z_lo)
            high += x_hi * (c_hi - z_hi)
        if TWO_GROUPS:
            return low, high
        return low + high


@triton.jit
def _half_to_f32(bits):
    # int32 holding fp16 bits in its low half -> fp32
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _half_bits(x):
    # fp16 -> its 16 bits in the low half of an int32
    return x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _x_column(x_ptr, norm_ptr, perm_ptr, cols, row_live, NORM: tl.constexpr):
    # x[perm[cols]] in fp16 [R] (act-order), zero where not row_live; with NORM, times the norm weight
    src = tl.load(perm_ptr + cols, mask=row_live, other=0)
    x = tl.load(x_ptr + src, mask=row_live, other=0.0)
    if NORM:
        x = tl.load(norm_ptr + src, mask=row_live, other=0.0) * x
    return x


@triton.jit
def _x_gathered_pair(x_ptr, norm_ptr, perm_ptr, cols, row_live, NORM: tl.constexpr):
    # half2 (x[perm[cols]], x[perm[cols + 32]]) as int32 [R]: act-order reads x element by element (nibbles j and
    # j + 4 of a word are input rows 32 apart)
    lo = _x_column(x_ptr, norm_ptr, perm_ptr, cols, row_live, NORM)
    hi = _x_column(x_ptr, norm_ptr, perm_ptr, cols + 32, row_live, NORM)
    return _half_bits(lo) | (_half_bits(hi) << 16)


@triton.jit
def _hmul2(a, b, USE_ASM: tl.constexpr):
    # half2 product of two int32 words holding fp16 pairs (round to nearest, as fp16 multiplies round)
    if USE_ASM:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)
    lo = (_half_to_f32(a & 0xFFFF) * _half_to_f32(b & 0xFFFF)).to(tl.float16)  # fp16 x fp16 is exact in fp32
    hi = (_half_to_f32((a >> 16) & 0xFFFF) * _half_to_f32((b >> 16) & 0xFFFF)).to(tl.float16)
    return _half_bits(lo) | (_half_bits(hi) << 16)


@triton.jit
def _pair(lo_word, hi_word, high, USE_ASM: tl.constexpr):
    # half2 (low or high half of lo_word, the same half of hi_word) as int32, the half chosen per element by
    # ``high`` (0 or 1, int32): one byte permute (PRMT) whose selector, 0x5410 or 0x7632, is a constant where
    # ptxas can fold it (a large matrix's rows all sit in each thread) and one register otherwise
    if USE_ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [lo_word, hi_word, 0x5410 + high * 0x2222], dtype=tl.int32, is_pure=True,
                                         pack=1)
    low = (lo_word & 0xFFFF) | (hi_word << 16)
    return tl.where(high != 0, ((lo_word >> 16) & 0xFFFF) | (hi_word & -65536), low)  # -65536: 0xFFFF0000


@triton.jit
def _x_word_pair(xw_ptr, nw_ptr, offs, high, row_live, NORM: tl.constexpr, USE_ASM: tl.constexpr):
    # one pair of _x_word_pairs: half ``high`` of x words offs (low) and offs + 16 (high), [R] each
    lo = tl.load(xw_ptr + offs, mask=row_live, other=0)
    hi = tl.load(xw_ptr + offs + 16, mask=row_live, other=0)
    if NORM:
        lo = _hmul2(lo, tl.load(nw_ptr + offs, mask=row_live, other=0), USE_ASM)
        hi = _hmul2(hi, tl.load(nw_ptr + offs + 16, mask=row_live, other=0), USE_ASM)
    return _pair(lo, hi, high, USE_ASM)


@triton.jit
def _x_word_pairs(xw_ptr, nw_ptr, k0, rr, row_live, NORM: tl.constexpr, USE_ASM: tl.constexpr):
    # the four half2 pairs (x[64b + 8j + w], x[64b + 8j + 32 + w]), j = 0..3, that nibbles j and j + 4 of packed
    # row k0 / 8 + rr [R] multiply (row w = rr % 8 of 64-row block b), from x's 32-bit words [K / 2]: x[64b + 8j + w]
    # is half w % 2 of word 32b + 4j + w // 2, its partner the same half of word 32b + 4j + 16 + w // 2; with NORM,
    # x times the norm weight in half2. Rows not ``row_live`` read as zeros. k0 is a multiple of 64, so the step's
    # offset is added once (a scalar) and the rows' offsets in it are constants: rows w and w + 1 then load the same
    # words, and where one thread holds both the loads merge (8 loads and 8 PRMTs per two rows, as a row of
    # words 4r .. 4r + 3 took in GPTQ's order); offsets from each row's global index took 29.2 instructions a
    # word instead of 23.2. [R] loads, not one [R, 4] split into columns: that went through shared memory
    xw_ptr += k0 // 2
    nw_ptr += k0 // 2
    offs = rr // 8 * 32 + rr % 8 // 2  # [R] word of pair 0
    high = rr % 2
    return (_x_word_pair(xw_ptr, nw_ptr, offs, high, row_live, NORM, USE_ASM),
            _x_word_pair(xw_ptr, nw_ptr, offs + 4, high, row_live, NORM, USE_ASM),
            _x_word_pair(xw_ptr, nw_ptr, offs + 8, high, row_live, NORM, USE_ASM),
            _x_word_pair(xw_ptr, nw_ptr, offs + 12, high, row_live, NORM, USE_ASM))


@triton.jit
def _zero_terms(z_low, z_high, USE_ASM: tl.constexpr):
    # the half2 zero terms (1024 + zero, -(64 + zero)) as int32 of the zeros (fp16 integers 0..15) of a word's
    # low and high nibbles: one pack and two half2 ops (both exact), where converting each zero took ~6
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 z, c;
            mov.b32 z, {$2, $3};
            mov.b32 c, 0x64006400;
            add.f16x2 $0, z, c;
            mov.b32 c, 0xD400D400;
            sub.f16x2 $1, c, z;
            }""",
            constraints="=r,=r,h,h",
            args=[z_low, z_high],
            dtype=(tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    zz_low = z_low.to(tl.int32) | 0x6400  # fp16 bits of 1024 + zero
    zz_high = z_high.to(tl.int32) | 0x6400
    zm_low = _half_bits((-64.0 - z_low.to(tl.float32)).to(tl.float16))
    zm_high = _half_bits((-64.0 - z_high.to(tl.float32)).to(tl.float16))
    return zz_low | (zz_high << 16), zm_low | (zm_high << 16)


@triton.jit
def _weight_step(qw_ptrs, scales_ptr, zeros_ptr, k0, k_end, rows, rn, n_mask, N, GROUP: tl.constexpr,
                 ROW_GROUPS: tl.constexpr, TWO_GROUPS: tl.constexpr, MASK_ROWS: tl.constexpr,
                 USE_ASM: tl.constexpr, X16: tl.constexpr):
    # the packed words [R, BN] of the K step at k0 (qw_ptrs point at them), its scales, a second scale and the
    # half2 zero terms (1024 + zero, -(64 + zero)) as int32, [R, BN] when the step's blocks lie in different
    # groups, else [1, BN]. TWO_GROUPS (a group of 32 rows, or any that is not whole 64-row blocks): a packed row's
    # nibbles 0-3 (its block's first 32 rows) and 4-7 (the next 32) may lie in two groups, so each half of the
    # zero terms holds its own zero and the two scales are returned as loaded, fp16 (converted where used, from
    # the halves of the loaded registers: fp32 copies held a one-step plan's whole K twice); otherwise the scale
    # is fp32 and the second one 0.0, unused. X16 (the integer dot): the zeros of the low and high halves as int32
    # in place of the half2 terms.
    # A step lies wholly inside or wholly past its split (k_per_split is a whole number of steps), so one
    # scalar masks the load of the step after the last; with MASK_ROWS (a split's whole K in one step wider
    # than it) each row is masked to the split's end: a split is whole 64-row blocks and packed row p is in
    # block p // 8, so it is live when its block starts before the end, 8p < k_end
    live = (n_mask & ((k0 + rn * 0) < k_end))[None, :]  # (a tensor mask: the interpreter mistypes scalar-bool & tensor)
    if MASK_ROWS:
        live = live & (rows * 8 < k_end)[:, None]
    qw = tl.load(qw_ptrs, mask=live, other=0, eviction_policy="evict_first")
    if ROW_GROUPS:
        first = rows // 8 * 64  # the first input row of each packed row's block
        g = (first // GROUP)[:, None] * N + rn[None, :]  # [R, BN]
        g_high = ((first + 32) // GROUP)[:, None] * N + rn[None, :]  # its second 32 rows' group
    else:  # the step is one block (TWO_GROUPS) or inside one group
        g = (k0 // GROUP) * N + rn[None, :]  # [1, BN]
        g_high = ((k0 + 32) // GROUP) * N + rn[None, :]
    s = tl.load(scales_ptr + g, mask=live, other=0.0)
    z = tl.load(zeros_ptr + g, mask=live, other=0.0)
    if TWO_GROUPS:
        s_high = tl.load(scales_ptr + g_high, mask=live, other=0.0)
        z_high = tl.load(zeros_ptr + g_high, mask=live, other=0.0)
    else:  # (g_high is g: unused)
        s = s.to(tl.float32)
        s_high = 0.0
        z_high = z
    if X16:
        zz, zm = z.to(tl.int32), z_high.to(tl.int32)
    else:
        zz, zm = _zero_terms(z, z_high, USE_ASM)
    return qw, s, s_high, zz, zm


@triton.jit
def _step_dot(x_ptr, norm_ptr, perm_ptr, k0, k_end, rr, qw, s, s_high, zz, zm, NORM: tl.constexpr, HAS_PERM: tl.constexpr,
              USE_ASM: tl.constexpr, MASK_ROWS: tl.constexpr, ROW_GROUPS: tl.constexpr, TWO_GROUPS: tl.constexpr):
    # the K step at k0 (a multiple of 64): sum over its packed rows of x . (codes - zero) * scale, fp32 [BN];
    # with MASK_ROWS, rows past k_end read x as zeros (their weights and scales are masked to zero too)
    if MASK_ROWS:
        row_live = k0 + rr * 8 < k_end
    else:  # a constant mask: folded away
        row_live = tl.full(rr.shape, 1, tl.int1)
    if HAS_PERM:
        cols = _plane_rows(k0, rr, 0)  # the input row of nibble 0 of each packed row
        x04 = _x_gathered_pair(x_ptr, norm_ptr, perm_ptr, cols, row_live, NORM)
        x15 = _x_gathered_pair(x_ptr, norm_ptr, perm_ptr, cols + 8, row_live, NORM)
        x26 = _x_gathered_pair(x_ptr, norm_ptr, perm_ptr, cols + 16, row_live, NORM)
        x37 = _x_gathered_pair(x_ptr, norm_ptr, perm_ptr, cols + 24, row_live, NORM)
    else:
        x04, x15, x26, x37 = _x_word_pairs(x_ptr.to(tl.pointer_type(tl.int32), bitcast=True),
                                           norm_ptr.to(tl.pointer_type(tl.int32), bitcast=True), k0, rr,
                                           row_live, NORM, USE_ASM)
    R: tl.constexpr = rr.shape[0]
    if USE_ASM and not TWO_GROUPS and not ROW_GROUPS and R % 2 == 0:  # two rows a half2 sum: [R / 2, BN]
        qa, qb = _row_halves(qw, R, qw.shape[1])
        xa04, xb04 = _row_halves(x04[:, None], R, 1)
        xa15, xb15 = _row_halves(x15[:, None], R, 1)
        xa26, xb26 = _row_halves(x26[:, None], R, 1)
        xa37, xb37 = _row_halves(x37[:, None], R, 1)
        dots = _two_words_dot(qa, qb, xa04, xa15, xa26, xa37, xb04, xb15, xb26, xb37, zz, zm)
    else:
        dots = _word_dot(qw, x04[:, None], x15[:, None], x26[:, None], x37[:, None], zz, zm, TWO_GROUPS,
                         USE_ASM)  # [R, BN], or its low and high halves' sums with TWO_GROUPS
    # (one return: Triton 3.6 compiles on past a return in a taken constexpr branch)
    if TWO_GROUPS:  # each half by its group's scale
        low, high = dots
        s_low = s.to(tl.float32)
        s_high = s_high.to(tl.float32)
        if ROW_GROUPS:
            total = tl.sum(low * s_low + high * s_high, axis=0)
        else:  # one pair of scales a column: rows first, two multiplies
            total = tl.sum(low, axis=0) * tl.sum(s_low, axis=0) + tl.sum(high, axis=0) * tl.sum(s_high, axis=0)
    elif ROW_GROUPS:  # a scale per packed row
        total = tl.sum(dots * s, axis=0)
    else:  # one scale a column (s [1, BN]): rows first, one multiply
        total = tl.sum(dots, axis=0) * tl.sum(s, axis=0)
    return total


def _x16_dot_ptx(two_groups: bool) -> str:
    """The PTX of ``_x16_word_dot``: a packed word's even and odd nibbles as bytes (one AND, one shift and AND),
    each byte pair times its int16 pair of x in a DP2A (16 x 8-bit products summed in int32, exact). Inputs: the
    word, then the pairs of rows (+0, +16), (+8, +24), (+32, +48), (+40, +56); with ``two_groups`` the sums of
    nibbles 0-3 and 4-7 are two outputs (inputs from $2)."""
    first = 2 if two_groups else 1
    q, x0, x1, x2, x3 = (f"${first + i}" for i in range(5))
    low, high = ("$0", "$1") if two_groups else ("$0", "$0")
    lines = [
        ".reg .b32 even, odd;",
        f"and.b32 even, {q}, 0x0F0F0F0F;",  # bytes: nibbles 0, 2, 4, 6 (rows +0, +16, +32, +48)
        f"shr.u32 odd, {q}, 4;",
        "and.b32 odd, odd, 0x0F0F0F0F;",  # nibbles 1, 3, 5, 7 (rows +8, +24, +40, +56)
        f"dp2a.lo.s32.u32 {low}, {x0}, even, 0;",
        f"dp2a.lo.s32.u32 {low}, {x1}, odd, {low};",
        f"dp2a.hi.s32.u32 {high}, {x2}, even, {'0' if two_groups else high};",
        f"dp2a.hi.s32.u32 {high}, {x3}, odd, {high};",
    ]
    return "{\n" + "".join(f"            {line}\n" for line in lines) + "            }"


_X16_DOT_PTX: tl.constexpr = tl.constexpr(_x16_dot_ptx(two_groups=False))
_X16_DOT_HALVES_PTX: tl.constexpr = tl.constexpr(_x16_dot_ptx(two_groups=True))


@triton.jit
def _x16_word_dot(qw, xp0, xp1, xp2, xp3, TWO_GROUPS: tl.constexpr, USE_ASM: tl.constexpr):
    """sum_j q_j * code_j over the 8 nibbles of each packed word, in int32 (exact): qw [R, BN] int32; xp0 .. xp3
    int32 [R, 1], the int16 pairs of x in 16-bit fixed point (reference.quantize_x16) of nibbles (0, 2), (1, 3),
    (4, 6), (5, 7). With TWO_GROUPS the sums of nibbles 0-3 (the block's first 32 rows) and 4-7 apart, as a
    tuple (at group size 32 each is a group)."""
    if USE_ASM and TWO_GROUPS:
        return tl.inline_asm_elementwise(asm=_X16_DOT_HALVES_PTX, constraints="=r,=r,r,r,r,r,r",
                                         args=[qw, xp0, xp1, xp2, xp3], dtype=(tl.int32, tl.int32), is_pure=True,
                                         pack=1)
    elif USE_ASM:
        return tl.inline_asm_elementwise(asm=_X16_DOT_PTX, constraints="=r,r,r,r,r,r", args=[qw, xp0, xp1, xp2, xp3],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:  # the interpreter has no inline asm: the same integer sums
        low = (_nibble(qw, 0) * _low16(xp0) + _nibble(qw, 2) * (xp0 >> 16)
               + _nibble(qw, 1) * _low16(xp1) + _nibble(qw, 3) * (xp1 >> 16))
        high = (_nibble(qw, 4) * _low16(xp2) + _nibble(qw, 6) * (xp2 >> 16)
                + _nibble(qw, 5) * _low16(xp3) + _nibble(qw, 7) * (xp3 >> 16))
        if TWO_GROUPS:
            return low, high
        return low + high


@triton.jit
def _nibble(qw, j: tl.constexpr):
    return (qw >> (4 * j)) & 0xF


@triton.jit
def _low16(pair):
    # the sign-extended low int16 of an int32 pair
    return (pair << 16) >> 16


@triton.jit
def _step_dot_x16(x16_ptr, K, k0, k_end, rr, qw, s, s_high, z, z_high, MASK_ROWS: tl.constexpr,
                  ROW_GROUPS: tl.constexpr, TWO_GROUPS: tl.constexpr, USE_ASM: tl.constexpr):
    # ``_step_dot`` with x in 16-bit fixed point (x16_ptr: reference.quantize_x16's int32 planes [7, K / 8]): per
    # packed row the integer sums q . code (DP2A), minus zero * q's sum over the row's nibbles, to fp32 times the
    # weight's and x's block scales. A step of one 64-row block (R = 8) has one x scale and, unless ROW_GROUPS,
    # one zero and scale a column: its rows are summed as integers (exact: |sum| < 2^25) and converted once a
    # column, with the block's scalars; wider steps convert each row's sum
    K8 = K // 8
    first = tl.multiple_of(k0 // 8, 8)  # the step's first packed row: a block's first (16-byte loads below)
    p = first + rr  # [R] packed rows
    if MASK_ROWS:
        row_live = k0 + rr * 8 < k_end
    else:
        row_live = tl.full(rr.shape, 1, tl.int1)
    xp0 = tl.load(x16_ptr + p, mask=row_live, other=0)
    xp1 = tl.load(x16_ptr + K8 + p, mask=row_live, other=0)
    xp2 = tl.load(x16_ptr + 2 * K8 + p, mask=row_live, other=0)
    xp3 = tl.load(x16_ptr + 3 * K8 + p, mask=row_live, other=0)
    dots = _x16_word_dot(qw, xp0[:, None], xp1[:, None], xp2[:, None], xp3[:, None], TWO_GROUPS, USE_ASM)
    R: tl.constexpr = rr.shape[0]
    PER_ROW: tl.constexpr = ROW_GROUPS or R > 8  # rows of more than one block or group: convert each
    blocks = x16_ptr + 6 * K8  # per block: scale bits, the sums of its first and second 32 rows
    if PER_ROW:
        sum_low = tl.load(x16_ptr + 4 * K8 + p, mask=row_live, other=0)  # [R] q summed over nibbles 0-3
        sum_high = tl.load(x16_ptr + 5 * K8 + p, mask=row_live, other=0)
        x_scale = tl.load(blocks + p // 8 * 8, mask=row_live, other=0).to(tl.float32, bitcast=True)  # [R]
    else:  # one block: three scalars
        sum_low = tl.load(blocks + first + 1)
        sum_high = tl.load(blocks + first + 2)
        x_scale = tl.load(blocks + first).to(tl.float32, bitcast=True)
    if TWO_GROUPS:
        low, high = dots
        if PER_ROW:
            rows = ((low - z * sum_low[:, None]).to(tl.float32) * s.to(tl.float32)
                    + (high - z_high * sum_high[:, None]).to(tl.float32) * s_high.to(tl.float32))
            total = tl.sum(rows * x_scale[:, None], axis=0)
        else:  # one block: its two halves' zeros and scales a column
            low_sum = tl.sum(low, axis=0) - tl.sum(z, axis=0) * sum_low  # [BN] int32
            high_sum = tl.sum(high, axis=0) - tl.sum(z_high, axis=0) * sum_high
            total = (low_sum.to(tl.float32) * tl.sum(s.to(tl.float32), axis=0)
                     + high_sum.to(tl.float32) * tl.sum(s_high.to(tl.float32), axis=0)) * x_scale
    elif PER_ROW:
        rows = (dots - z * (sum_low + sum_high)[:, None]).to(tl.float32) * s
        total = tl.sum(rows * x_scale[:, None], axis=0)
    else:  # one block inside one group
        block = tl.sum(dots, axis=0) - tl.sum(z, axis=0) * (sum_low + sum_high)  # [BN] int32
        total = block.to(tl.float32) * (tl.sum(s, axis=0) * x_scale)
    return total


@triton.jit
def _gemv_kernel(
    x_ptr,
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    perm_ptr,
    x16_ptr,
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
    GROUP: tl.constexpr,
    NORM: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_PERM: tl.constexpr,
    USE_ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    ONE_STEP: tl.constexpr,
    PRESCALED: tl.constexpr,
    NEXT_NORM: tl.constexpr,
    X16_OUT: tl.constexpr,
    X16: tl.constexpr,
    WEIGHTS_FIRST: tl.constexpr,
):
    # x [K] @ W [K, N]; grid = (column tiles, splits); fp32 partials [splits, N] in part_ptr. X16: the dot reads x
    # in 16-bit fixed point from x16_ptr (reference.quantize_x16; x then gives only the rms). ONE_STEP: each
    # program's split is one K step of BLOCK_K >= k_per_split rows (masked past it), all loaded at once. The
    # one-step tile spreads its rows over the warps, so a thread's rows lie in different blocks and each loads
    # its own x words (SmolLM2 qkv 253 registers); mapping tile rows i and i + R / 2 to packed rows 2i and 2i + 1
    # (one block's pair) took 175 but measured slower (qkv 3.34 -> 4.09 us, down 2.57 -> 2.80; H200, session 15)
    # PRESCALED (with NORM): the dot reads x * norm weight from normed_ptr, which the previous launch's
    # NEXT_NORM epilogue wrote (a residual GEMV also stores residual * the next norm's weight to normed_out_ptr);
    # x itself then gives only the rms
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    R: tl.constexpr = BLOCK_K // 8  # packed rows per K step (BLOCK_K: whole 64-row blocks)
    TWO_GROUPS: tl.constexpr = GROUP % 64 != 0  # a block's two 32-row halves may lie in different groups
    # the step's blocks in different groups: scales per packed row
    ROW_GROUPS: tl.constexpr = ONE_STEP or BLOCK_K > (64 if TWO_GROUPS else GROUP)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rr = tl.arange(0, R)  # the step's packed rows
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # the first step's weights are loaded before waiting on the previous kernel (programmatic dependent
    # launch): they do not depend on it, so their HBM latency overlaps its tail and this launch (WEIGHTS_FIRST;
    # else the wait comes first, for timing whether those requests hold back that tail); each step then loads
    # the next one's into registers while it computes (Triton's shared-memory pipeline was never faster)
    if USE_PDL and not WEIGHTS_FIRST:
        gdc_wait()
        gdc_launch_dependents()
    qw_ptrs = qw_ptr + (k_start // 8 + rr).to(tl.int64)[:, None] * N + rn[None, :]  # [R, BN], advanced a step at a time
    qw, s, s_high, zz, zm = _weight_step(qw_ptrs, scales_ptr, zeros_ptr, k_start, k_end, k_start // 8 + rr, rn,
                                         n_mask, N, GROUP, ROW_GROUPS, TWO_GROUPS, ONE_STEP, USE_ASM, X16)
    pos, slot = rope_position(pos_ptr, slot_ptr, EPILOGUE)
    if USE_PDL and WEIGHTS_FIRST:
        gdc_wait()
        gdc_launch_dependents()
    MUL_NORM: tl.constexpr = NORM and not PRESCALED  # the dot multiplies x by the norm weight itself
    dot_ptr, x_slice = dot_input(x_ptr, normed_ptr, k_start, k_end, NORM, PRESCALED, EPILOGUE, SPLITS, NORM_BLOCK)
    if ONE_STEP and X16:
        y = _step_dot_x16(x16_ptr, K, k_start, k_end, rr, qw, s, s_high, zz, zm, True, ROW_GROUPS, TWO_GROUPS, USE_ASM)
    elif ONE_STEP:
        y = _step_dot(dot_ptr, norm_ptr, perm_ptr, k_start, k_end, rr, qw, s, s_high, zz, zm, MUL_NORM, HAS_PERM, USE_ASM, True,
                      ROW_GROUPS, TWO_GROUPS)
    else:
        # each step's rows are summed as it ends ([BN] carried, not [R, BN]): a large matrix's rows sit in one
        # thread, so the sum is register adds, and 28 fewer registers stay live across the loop
        y = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            qw_ptrs += R * N
            qw_next, s_next, s_high_next, zz_next, zm_next = _weight_step(qw_ptrs, scales_ptr, zeros_ptr, k0 + BLOCK_K, k_end,
                                                             (k0 + BLOCK_K) // 8 + rr, rn, n_mask, N, GROUP,
                                                             ROW_GROUPS, TWO_GROUPS, False,
                                                             USE_ASM, X16)  # masked past the split's end
            if X16:
                y += _step_dot_x16(x16_ptr, K, k0, k_end, rr, qw, s, s_high, zz, zm, False, ROW_GROUPS, TWO_GROUPS,
                                   USE_ASM)
            else:
                y += _step_dot(dot_ptr, norm_ptr, perm_ptr, k0, k_end, rr, qw, s, s_high, zz, zm, MUL_NORM, HAS_PERM,
                               USE_ASM, False, ROW_GROUPS, TWO_GROUPS)
            qw, s, s_high, zz, zm = qw_next, s_next, s_high_next, zz_next, zm_next
    # y [BLOCK_N]; with NORM, still to be scaled by 1 / rms(x)
    finish_tile(y, x_slice, pid_n, pid_k, x_ptr, out_ptr, part_ptr, squares_ptr, lock_ptr, cos_sin_ptr, pos, slot,
                k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr, bias_ptr, next_norm_ptr, normed_out_ptr, x16_out_ptr, rn, n_mask, N,
                K,
                splits, lock_rest, eps, qk_eps, NORM, EPILOGUE, Q_SIZE, KV_SIZE, HEAD_DIM, QK_NORM, HAS_BIAS, SPLITS,
                NORM_BLOCK, NEXT_NORM, X16_OUT, BLOCK_N, HEAD_DIM // 2)  # a tile holds whole heads


@dataclass(frozen=True)
class GemvPlan:
    """Tile and split-K of one GEMV launch. ``one_step``: each program loads its whole split at once (one K
    step of the next power of two rows, masked; ``block_k`` unused), so a small matrix is one HBM round trip
    per program and, at one split, finishes without partials."""

    block_n: int
    block_k: int
    split: int
    num_warps: int
    one_step: bool = False
    max_registers: int | None = None  # ptxas's cap (Triton's maxnreg); None: ptxas chooses
    weights_first: bool = True  # the first K step's weights loaded before the PDL wait (False: after it)


SMALL_MATRIX = 1 << 22  # weights; SmolLM2's largest, gate/up 576 x 3072, has 1.8M
SMALL_MATRIX_WARPS = 8  # a small matrix's column tile: all of K in one program, the rows over 8 warps
ONE_STEP_WORDS = 32  # packed words a thread may hold in a one-step plan: at 32, 97-192 registers, no spills
LARGE_MATRIX_REGISTERS = 128  # uncapped, Triton 3.6 gives 168-174 (the epilogue's partial tiles): 12 warps an SM
RESIDENT_WARPS = warps_an_sm_holds(LARGE_MATRIX_REGISTERS)  # warps an SM holds at the cap: 16


def gemv_large_matrix(k: int, n: int) -> bool:
    """A K x N weight the GEMV streams with the large-matrix plans (128-column tiles of 1 warp, split-K), not
    the small one-step ones."""
    return k * n > SMALL_MATRIX


def gemv_plan(n: int, k: int, group_size: int, sms: int, head_dim: int | None = None, norm: bool = False,
              warps_per_sm: int = 24, block_k: int = 64, one_wave: bool = True,
              weights_first: bool = True) -> GemvPlan:
    """Column tile, K step and split-K, from the sweeps of ``bench/gemv.py --sweep`` on an H200.

    A large matrix takes one warp per 128 columns: Triton then gives each thread four adjacent columns of
    every packed row (one 16-byte load), so a row's four x pairs serve four words (22 SASS instructions a
    word; 32-column tiles, a column a thread, took 29 and a shared-memory pass for the scales), in K steps of 64
    rows, capped at ``LARGE_MATRIX_REGISTERS`` (the epilogue's partial tiles otherwise set the whole kernel's
    count: 8B gate/up 26.8 -> 24.0 us with the cap, down 14.3 -> 13.0). The split gives ~``warps_per_sm`` warps
    an SM, at most ``MAX_SPLIT``, and (``one_wave``) no more programs than the SMs hold at once
    (``RESIDENT_WARPS``): the rule's 24 warps an SM put the 7B qkv's 3,072 one-warp programs on 2,112 slots, and
    rounding up put gate/up's 2,236-2,240 there, so 124-960 programs waited for a second wave and the launch's
    tail was their whole K loop at a few programs an SM (on the H200, 12 warps an SM took the 7B qkv from 14.3 to
    11.7 us; ``one_wave=False``: the rule before, for A/Bs). With an
    RMSNorm prologue each program keeps at least two K steps (measured when every program reduced the row; now
    each split sums the squares of its own slice, and the rule is not re-measured). A small matrix is latency, not
    bandwidth: each column tile is one program that loads all of K at once over 8 warps (one HBM round trip)
    and sums it in the program, with no partials or ticket. ``block_k``: a large matrix's K step (rows, a
    multiple of 64; 128 is for timing it against 64, the steps of the sweeps above). ``weights_first=False``:
    the first step's weights (a small matrix's whole split) are loaded after the PDL wait, not before it, for
    timing whether their requests delay the previous launch's tail (two steps before the wait lost 0.4-1.6 us on
    every 7B / 8B launch, session 31)."""
    if interpreting():
        return GemvPlan(max(16, head_dim or 16), 64, max(1, min(2, k // 64)), 1,  # a K step is whole blocks
                        weights_first=weights_first)
    if not gemv_large_matrix(k, n):
        block_n = max(32, head_dim or 1)
        split = 1  # more splits only where one program's K would not fit in registers
        while _one_step_words(k, split, block_n) > ONE_STEP_WORDS and split < k // 64:
            split *= 2
        return GemvPlan(block_n, 0, split, SMALL_MATRIX_WARPS, one_step=True, weights_first=weights_first)
    block_k = largest_pow2_divisor(k, block_k)  # whole 64-row blocks (K is whole blocks): no row mask needed
    steps = k // block_k
    block_n = max(128, head_dim or 1)  # a ROPE launch's tiles hold whole heads
    warps = block_n // 128
    most = steps // 2 if norm else steps
    if norm and head_dim is None:  # gate/up: the grid sized to the 16 warps an SM that 128 registers allow
        warps_per_sm = min(warps_per_sm, RESIDENT_WARPS)
    tiles = cdiv(n, block_n)
    split = max(1, min(most, cdiv(warps_per_sm * sms, tiles * warps), MAX_SPLIT))
    if one_wave:
        split = max(1, min(split, RESIDENT_WARPS * sms // (tiles * warps)))
    return GemvPlan(block_n, block_k, split, warps, max_registers=LARGE_MATRIX_REGISTERS, weights_first=weights_first)


def launch_plan(device: torch.device, n: int, k: int, group_size: int, head_dim: int | None = None,
                norm: bool = False) -> GemvPlan:
    """The plan a launch takes: ``gemv_plan``'s rule with the grid (warps an SM, K step) measured fastest for this
    weight shape on this card, where ``tuned/w4a16_gemv.json`` has one (``bench/gemv.py --x16`` times grids of
    both dots; an entry is a grid that served both: BENCHMARKS.md issue 15, session 19). On the H200 the
    7B qkv launch took 14.3 us at the rule's 24 warps an SM and 11.7 at 12. An entry may also lift the one-wave
    cap (``one_wave: false``, a candidate of the same sweep; no card's table has one: session 26)."""
    sms = num_sms(device)
    tuned = None if interpreting() else tuned_tile("w4a16_gemv", device_name(device), k, n, 1)
    if tuned is None:
        return gemv_plan(n, k, group_size, sms, head_dim, norm)
    return gemv_plan(n, k, group_size, sms, head_dim, norm, **tuned)  # warps_per_sm, block_k, one_wave


def _one_step_split(k: int, split: int) -> tuple[int, int, int]:
    """(rows per split, splits, K step) of a one-step plan: K cut into ``split`` parts of whole 64-row blocks (a
    packed row's nibbles span its block), each loaded as one step of the next power of two rows (masked past the
    part: whole blocks, so a packed row is wholly inside or past it)."""
    k_per_split = cdiv(k // 64, max(1, split)) * 64
    return k_per_split, cdiv(k, k_per_split), next_pow2(k_per_split)


def _one_step_words(k: int, split: int, block_n: int) -> int:
    """Packed words each thread of a small-matrix program loads in a one-step plan of ``split`` splits."""
    return _one_step_split(k, split)[2] // 8 * block_n // (32 * SMALL_MATRIX_WARPS)


def _k_steps(k: int, group_size: int, plan: GemvPlan) -> tuple[int, int, int]:
    """(rows per split, splits, K step) of a plan on a K-row weight: a one-step plan's (``_one_step_split``),
    otherwise splits of whole numbers of K steps of whole 64-row blocks. A group that is not whole blocks (32) has
    its scales looked up per 32-row half of every packed row, so any step fits it; a group of whole blocks and a
    step must nest (one scale row per step, or a scale row per packed row)."""
    if plan.one_step:
        return _one_step_split(k, plan.split)
    block_k = largest_pow2_divisor(k, max(plan.block_k, 64))
    if block_k < 64:
        raise ValueError(f"w4a16_gemv: K = {k} is not a whole number of 64-row blocks")
    if group_size % 64 == 0 and block_k % group_size and group_size % block_k:
        raise ValueError(f"w4a16_gemv: K step {block_k} and group size {group_size} do not nest")
    return (*split_k(k, block_k, plan.split), block_k)


def register_cap(plan: GemvPlan, act_order: bool) -> int | None:
    """The plan's register cap as launched: none for act-order, whose element-wise x gathers spill 40 B under it
    (compiled for sm_90) and were not measured capped."""
    return None if act_order else plan.max_registers


def gemv_supported(x: torch.Tensor, k: int, group_size: int) -> bool:
    """fp16 activations (the half2 dot), one row, K whole 64-row blocks of the packed layout (a word's nibbles
    span its block) and groups of whole 32-row halves of blocks (a half2 of nibbles j and j + 4 is one row of
    each half)."""
    return x.dtype == torch.float16 and x.shape[0] == 1 and group_size % 32 == 0 and k % 64 == 0


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    normed: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    next_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    silu: bool = False,
    rope: dict | None = None,
    bias: torch.Tensor | None = None,
    x16: torch.Tensor | None = None,
    x16_out: torch.Tensor | None = None,
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """y = x @ W for one row, with optional fused neighbours.

    x [1, K] fp16; qweight [K // 8, N] int32; scales, zeros [K // G, N] fp16 (integer zeros); perm [K] | None.
    norm_weight [K]: x is first RMS-normalised (reference.rms_norm(x, norm_weight, eps)[0]). normed [1, K] (with
    norm_weight): x * norm_weight in fp16, as a ``next_norm`` epilogue wrote it; the dot reads it instead of
    multiplying x by the weight itself in its loop (BENCHMARKS.md issue 15, session 17), x gives the rms.
    residual [1, N]: returns residual += y (in place); next_norm = (weight [N], out [1, N]) with it: out is also
    written with the new residual * weight (the next launch's ``normed``). silu: W holds gate then up columns: returns
    silu(gate) * up [1, N // 2]. rope: dict(positions [1], slot_mapping [1], cos_sin_cache [max_pos, D] fp32,
    k_cache, v_cache [blocks, block_size, KH, D], q_size, kv_size, head_dim; Qwen3 also q_norm, k_norm [D] and
    eps): W is qkv; writes rotary k and v to the slot and returns rotary q [1, q_size]. bias [N]: added to
    y before any epilogue (Qwen2's qkv, Llama's optional o / MLP biases). x16: the dot's row (x, or ``normed``
    with a norm) in 16-bit fixed point, ``reference.quantize_x16``'s int32 planes [7, K // 8], which the dot reads
    instead (integer DP2A products: fewer instructions a word than the half2 dot); x still gives the rms.
    x16_out [7, width // 8] (with next_norm or silu): the row this launch writes for the next GEMV (the next norm's
    input, or silu(gate) * up) also written in those planes, its ``x16``.
    """
    k = x.shape[1]
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k or scales.shape != (k // group_size, n) or zeros.shape != scales.shape:
        raise ValueError(f"w4a16_gemv: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}, group {group_size} disagree")
    if not gemv_supported(x, k, group_size):
        raise ValueError(f"w4a16_gemv: needs one fp16 row, K a multiple of 64 and a group size that is "
                         f"a multiple of 32 (x {tuple(x.shape)}, {x.dtype}, group {group_size})")
    _check_x16(x16, k, perm, norm_weight, normed)
    x = x.contiguous()
    head_dim = rope["head_dim"] if rope is not None else None
    plan = plan or launch_plan(x.device, n, k, group_size, head_dim, norm=norm_weight is not None)
    k_per_split, splits, block_k = _k_steps(k, group_size, plan)
    launch = epilogue_launch("w4a16_gemv", x, qweight, n, plan.block_n, k_per_split, splits, norm_weight=norm_weight,
                             eps=eps, normed=normed, residual=residual, next_norm=next_norm, silu=silu, rope=rope,
                             bias=bias, x16_out=x16_out)
    _gemv_kernel[(cdiv(n, plan.block_n), splits)](
        x, qweight, scales, zeros, perm if perm is not None else qweight, x16 if x16 is not None else qweight,
        *launch.args, GROUP=group_size, X16=x16 is not None,
        HAS_PERM=perm is not None, USE_ASM=not interpreting(), BLOCK_N=plan.block_n, BLOCK_K=block_k,
        ONE_STEP=plan.one_step, WEIGHTS_FIRST=plan.weights_first, num_warps=plan.num_warps, **launch.constexprs,
        **maxnreg_option(register_cap(plan, perm is not None)),
    )
    return launch.out


def _check_x16(x16: torch.Tensor | None, k: int, perm: torch.Tensor | None, norm_weight: torch.Tensor | None,
               normed: torch.Tensor | None) -> None:
    """x16 must be the dot's own row in ``quantize_x16``'s planes: not for act-order (x read through perm) nor
    a norm the kernel would multiply in itself (without ``normed``)."""
    if x16 is None:
        return
    check_x16_planes("w4a16_gemv: x16", x16, k)
    if perm is not None or (norm_weight is not None and normed is None):
        raise ValueError("w4a16_gemv: x16 is the dot's row as given: not with act-order, nor a norm without normed")
