"""The one-row GEMVs' shared tail: the RMSNorm prologue's 1 / rms, split-K partials and the fused epilogues.

The decode layer's neighbours of a matmul (issue 15) are the same whatever the weight's format: the RMSNorm
before it, and after it the residual add (o, down), silu(gate) * up (gate/up) or rotary + the KV-cache write
(qkv). Each one-row GEMV kernel (w4a16_gemv.py for packed int4, dense_gemv.py for fp16) computes its column
tile's product y [BLOCK_N] its own way and hands it to ``one_split_epilogue`` or ``split_epilogue`` here;
``epilogue_launch`` makes the outputs and the arguments of that tail on the host, so both launchers pass the same
pointers, scalars and constexprs in the same order (the kernels' parameters from ``out_ptr`` to ``qk_eps``).

- Prologue ``NORM``: RMSNorm of the residual stream, so the norm is not a launch of its own. 1 / rms is a
  scalar of the row: the kernel's dot multiplies x by the norm weight (or reads that product, PRESCALED); each
  split program also sums the squares of its own slice of x, and the program that finishes a column tile (the
  last split to arrive) reads those [splits] sums with the partials and scales the tile's sum (a lone program
  without partials reduces the row itself), so the row is never reduced inside the loop or twice in a tail.
- Epilogues: ``STORE`` (y), ``RESIDUAL`` (y added into the residual stream in place: o and down; NEXT_NORM also
  writes the new residual times the next norm's weight), ``SILU`` (gate and up tiles share one counter; the
  last of both writes silu(gate) * up), ``ROPE`` (qkv: rotary on the q and k columns, k and v written to their
  KV-cache slot, q stored; a tile holds whole heads or rotary pairs, so each column's rotary partner is in the
  same program, and its value is swapped between threads once the column is summed).
- Split-K: each program stores its fp32 partial and the last to arrive for a column tile finishes it
  (kernels/triton/split_k.py: no second kernel, no memset, CUDA-graph safe). That tail is latency at batch 1
  (the next launch waits on it), so it issues all its loads before it uses any: one L2 round trip after the
  ticket, where the squares' reduction, a second sum for the rotary partners, the position before its angles
  and the next norm's weight after the residual's store had each put one more on it (SASS, session 20). The
  position and KV-cache slot are read before the wait on the previous kernel (step inputs).

Rounding follows kernels/reference.py: outputs of the matmul round to fp16 before the epilogue's arithmetic, as
the unfused ops would see them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.reference import X16_MAX, X16_PLANES
from kernels.triton.common import cdiv, next_pow2, pdl_supported
from kernels.triton.split_k import LOCK_PERIOD, last_to_arrive, lock_buffer, rearm

STORE: tl.constexpr = tl.constexpr(0)  # epilogues
RESIDUAL: tl.constexpr = tl.constexpr(1)
SILU: tl.constexpr = tl.constexpr(2)
ROPE: tl.constexpr = tl.constexpr(3)
MAX_SPLIT = 32  # the last program of a tile sums one partial per split: 64 put ~2 us on 4096x4096's tail


@triton.jit
def inv_rms(x_ptr, K, eps, BLOCK: tl.constexpr):
    # 1 / sqrt(mean(x^2) + eps) over the row x [K] in fp32, BLOCK >= K: unrolled chunks of 1024, so the loads are
    # in flight together (one memory latency) while only a chunk's worth of registers is live at a time
    CHUNK: tl.constexpr = 1024 if BLOCK > 1024 else BLOCK  # noqa: FURB136 (constexpr arithmetic in @jit)
    acc = tl.zeros([CHUNK], tl.float32)
    for c in tl.static_range(BLOCK // CHUNK):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        v = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
        acc += v * v
    return _norm_scale(acc, K, eps, True)


@triton.jit
def _x_slice(x_ptr, k_start, k_end, BLOCK: tl.constexpr):
    # this split's slice x[k_start:k_end] [BLOCK] (fp16, zeros past it), BLOCK >= k_end - k_start: loaded with the
    # first step's x and reduced (``slice_squares``) only in the tail, so the loop's first loads do not wait for
    # the reduction's shuffles (one memory round trip at the start of a NORM launch, not two: SASS, session 20)
    offs = k_start + tl.arange(0, BLOCK)
    return tl.load(x_ptr + offs, mask=offs < k_end, other=0.0)


@triton.jit
def slice_squares(x_slice):
    # sum of x^2 over a split's slice (``_x_slice``) in fp32: a few elements a thread and one warp reduction, so
    # the finishing program reads [splits] sums instead of the whole row
    v = x_slice.to(tl.float32)
    return tl.sum(v * v, axis=0)


@triton.jit
def _split_squares(squares_ptr, column, tiles, splits, SPLITS: tl.constexpr):
    # the splits' sums of squares of their slices of x [SPLITS], stored [splits, tiles] by a column tile's programs
    sk = tl.arange(0, SPLITS)
    return tl.load(squares_ptr + sk * tiles + column, mask=sk < splits, other=0.0, cache_modifier=".cg")


@triton.jit
def _norm_scale(part_squares, K, eps, NORM: tl.constexpr):
    # the tile's scale: 1 / rms(x) from ``_split_squares`` with NORM, else 1
    if NORM:
        scale = 1.0 / tl.sqrt(tl.sum(part_squares, axis=0) / K + eps)
    else:
        scale = 1.0
    return scale


@triton.jit
def _tile_sum(part_ptr, cols, mask, splits, N, SPLITS: tl.constexpr, CHUNK: tl.constexpr):
    # sum over splits of the fp32 partials [splits, N] at cols -> fp32 [BN] (the caller scales and rounds it).
    # CHUNK splits' partials are loaded at once: one load per split put an L2 round trip per split on the
    # critical path; the rotary epilogue takes 16 splits at a time, since 2 x 32 at once (its columns' and their
    # partners', when partners were loaded too) set the register count of the whole kernel (8B qkv 12.3 -> 9.8
    # us with chunks; o, one tile, was 5% slower in chunks)
    sk = tl.arange(0, CHUNK)
    if CHUNK == SPLITS:
        tile = tl.load(part_ptr + sk[:, None] * N + cols[None, :], mask=(sk < splits)[:, None] & mask[None, :],
                       other=0.0, cache_modifier=".cg")  # [SPLITS, BN]
        total = tl.sum(tile, axis=0)
    else:
        total = tl.zeros(cols.shape, tl.float32)
        for s0 in range(0, splits, CHUNK):
            live = ((s0 + sk) < splits)[:, None] & mask[None, :]
            tile = tl.load(part_ptr + (s0 + sk)[:, None] * N + cols[None, :], mask=live, other=0.0,
                           cache_modifier=".cg")  # [CHUNK, BN]
            total += tl.sum(tile, axis=0)
    return total


@triton.jit
def _rounded(y, cols, mask, bias_ptr, HAS_BIAS: tl.constexpr):
    # the product y [BN] (fp32) as the unfused op returns it: rounded to fp16, plus the bias rounded again
    total = y.to(tl.float16).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        total = (total + bias).to(tl.float16).to(tl.float32)
    return total


@triton.jit
def _head_norm(t, weight, eps, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # RMSNorm of each head of the tile's columns t [BN] (fp16 values in fp32), as reference.rms_norm rounds it:
    # weight * fp16(t / rms(head)), weight [BN] fp16
    heads = tl.reshape(t * t, [BLOCK_N // HEAD_DIM, HEAD_DIM])
    inv = 1.0 / tl.sqrt(tl.sum(heads, axis=1) / HEAD_DIM + eps)  # [heads in the tile]
    inv_cols = tl.reshape(tl.broadcast_to(inv[:, None], [BLOCK_N // HEAD_DIM, HEAD_DIM]), [BLOCK_N])
    return (weight * (t * inv_cols).to(tl.float16)).to(tl.float32)


@triton.jit
def _rope_angles(cos_sin_ptr, pos, rn, HEAD_DIM: tl.constexpr):
    # cos and sin [BN] of each column's rotary angle at position ``pos`` (``rope_position``'s); a tail loads them
    # before its partials, so both arrive in one round trip
    HALF: tl.constexpr = HEAD_DIM // 2
    d = rn % HALF
    return tl.load(cos_sin_ptr + pos * HEAD_DIM + d), tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + d)


@triton.jit
def _partners(t, rn, n_mask, part_ptr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PARTNER: tl.constexpr):
    # t [BN] at columns rn -> each column's rotary partner's value (column d +- HEAD_DIM / 2 of its head), held by
    # another thread of the program. PARTNER > 0: the partner is PARTNER places away in the tile (whole heads in
    # column order), swapped between threads, where loading the partners' partials again from L2 put one more
    # round trip on a split launch's tail. PARTNER = 0: through the partial buffer (this tile's columns, whose
    # partials are summed), a barrier and a load; the fp16 GEMV's tiles of 4 rows that every thread holds took
    # 94 registers a thread for the swap, against 70 so (Triton 3.6, sm_90)
    if PARTNER > 0:
        pairs = tl.reshape(t, [BLOCK_N // (2 * PARTNER), 2, PARTNER])
        partners = tl.reshape(tl.flip(pairs, 1), [BLOCK_N])  # bits moved by xor: exact; shuffles, no barrier
    else:
        HALF: tl.constexpr = HEAD_DIM // 2
        tl.store(part_ptr + rn, t, mask=n_mask)
        tl.debug_barrier()  # every thread's columns are stored before any partner is read
        partner_cols = tl.where(rn % HEAD_DIM < HALF, rn + HALF, rn - HALF)
        partners = tl.load(part_ptr + partner_cols, mask=n_mask, other=0.0, cache_modifier=".cg")
    return partners


@triton.jit
def _rope_epilogue(t, rn, n_mask, out_ptr, part_ptr, cos, sin, slot, k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr,
                   qk_eps, Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
                   BLOCK_N: tl.constexpr, PARTNER: tl.constexpr):
    # the qkv tile's finished columns t [BN] (fp16 values in fp32, at columns rn) -> rotary q stored to out
    # [Q_SIZE]; rotary k and v written to the KV-cache slot (cos, sin: ``_rope_angles``; slot: ``rope_position``).
    # QK_NORM (Qwen3): each q and k head is RMS-normalized by q_norm / k_norm [HEAD_DIM] before rotary (a tile
    # holds whole heads). Each column's rotary partner comes from ``_partners``
    HALF: tl.constexpr = HEAD_DIM // 2
    d = rn % HEAD_DIM
    is_q = rn < Q_SIZE
    is_v = rn >= Q_SIZE + KV_SIZE
    if QK_NORM:  # v is not normalized (whole heads of v: the masks agree per head)
        weight = tl.where(is_q, tl.load(q_norm_ptr + d), tl.load(k_norm_ptr + d))
        t = tl.where(is_v, t, _head_norm(t, weight, qk_eps, BLOCK_N, HEAD_DIM))
    tp = _partners(t, rn, n_mask, part_ptr, HEAD_DIM, BLOCK_N, PARTNER)
    rotated = tl.where(d < HALF, t * cos - tp * sin, t * cos + tp * sin)
    tl.store(out_ptr + rn, rotated.to(tl.float16), mask=n_mask & is_q)
    live = n_mask & ((slot + rn * 0) >= 0)  # a tensor mask: the interpreter mistypes scalar-bool & tensor
    k_col = rn - Q_SIZE
    v_col = rn - Q_SIZE - KV_SIZE
    tl.store(k_cache_ptr + slot * KV_SIZE + k_col, rotated.to(tl.float16), mask=live & ~is_q & ~is_v)
    tl.store(v_cache_ptr + slot * KV_SIZE + v_col, t.to(tl.float16), mask=live & is_v)


@triton.jit
def rope_position(pos_ptr, slot_ptr, EPILOGUE: tl.constexpr):
    # ROPE: this step's position and KV-cache slot (int64 scalars; 0 for other epilogues). Step inputs, written
    # before the previous kernel ran, so a program reads them before waiting on it (PDL): in the last program's
    # tail the cos / sin rows then load beside the partials, not after a load of the position
    if EPILOGUE == ROPE:
        pos = tl.load(pos_ptr).to(tl.int64)
        slot = tl.load(slot_ptr).to(tl.int64)
    else:
        pos = 0
        slot = 0
    return pos, slot


X16_ROUND: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2^23: + and - it round an fp32 below 2^22 to even
X16_TOP: tl.constexpr = tl.constexpr(float(X16_MAX))  # a block's largest |value| maps to this q


@triton.jit
def store_x16(values, cols, n, x16_ptr, BLOCK_N: tl.constexpr):
    # the tile's values [BN] (fp32 holding the fp16 stored at columns ``cols``, contiguous from a multiple of 64)
    # written in 16-bit fixed point as kernels/reference.py's quantize_x16 lays out a row of n: the planes
    # [7, n / 8] the next GEMV's integer dot reads. A 64-column block lies wholly in one tile, so its largest
    # |value| is known here; blocks at or past n are not written. Column 64 blk + 8 j + w, with nibble
    # j = 4a + 2b + c, is half b of pair plane 2a + c at packed row 8 blk + w
    B: tl.constexpr = BLOCK_N // 64
    K8 = n // 8
    v = tl.reshape(values, [B, 2, 2, 2, 8])  # [blk, a, b, c, w]
    col = tl.reshape(cols, [B, 2, 2, 2, 8])
    amax = tl.max(tl.reshape(tl.abs(values), [B, 64]), axis=1)  # [B]
    inv = tl.where(amax > 0.0, X16_TOP / tl.where(amax > 0.0, amax, 1.0), 0.0)[:, None, None, None, None]
    scaled = tl.where(inv > 0.0, v * inv, 0.0)  # (a select between: no FMA with the rounding add below)
    q = ((scaled + X16_ROUND) - X16_ROUND).to(tl.int32)  # |q| <= 32767, rounded to nearest even
    low, high = tl.split(tl.permute(q, (0, 1, 3, 4, 2)))  # [blk, a, c, w]: halves b = 0 and 1
    pair_col, _ = tl.split(tl.permute(col, (0, 1, 3, 4, 2)))  # the column of each low half
    j = pair_col % 64 // 8
    row = pair_col // 64 * 8 + pair_col % 8  # packed row
    tl.store(x16_ptr + (2 * (j // 4) + j % 2) * K8 + row, (low & 0xFFFF) | (high << 16), mask=pair_col < n)
    halves = tl.sum(tl.sum(q, axis=3), axis=2)  # [blk, a, w]: q over a packed row's nibbles of half a
    half_col = tl.min(tl.min(col, axis=3), axis=2)  # 64 blk + 32 a + w
    tl.store(x16_ptr + (4 + half_col % 64 // 32) * K8 + half_col // 64 * 8 + half_col % 8, halves,
             mask=half_col < n)
    block_col = tl.min(tl.reshape(cols, [B, 64]), axis=1)  # [B]
    blocks = x16_ptr + 6 * K8 + block_col // 8  # at the block's first packed row: scale bits, the halves' sums
    live = block_col < n
    tl.store(blocks, (amax / X16_TOP).to(tl.int32, bitcast=True), mask=live)
    sums = tl.sum(halves, axis=2)  # [blk, a]
    low_sum, high_sum = tl.split(sums)
    tl.store(blocks + 1, low_sum, mask=live)
    tl.store(blocks + 2, high_sum, mask=live)


@triton.jit
def one_split_epilogue(y, part_ptr, rn, n_mask, N, out_ptr, cos_sin_ptr, pos, slot, k_cache_ptr, v_cache_ptr, q_norm_ptr,
                       k_norm_ptr, qk_eps, bias_ptr, next_norm_ptr, normed_out_ptr, x16_out_ptr, EPILOGUE: tl.constexpr,
                       Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
                       BLOCK_N: tl.constexpr, PARTNER: tl.constexpr, HAS_BIAS: tl.constexpr, NEXT_NORM: tl.constexpr,
                       X16_OUT: tl.constexpr):
    # one split: the program holds its tile's whole product y [BN] and finishes from registers (ROPE takes each
    # column's rotary partner from another thread of the program: ``_partners``; part_ptr: its exchange buffer)
    t = _rounded(y, rn, n_mask, bias_ptr, HAS_BIAS)
    if EPILOGUE == ROPE:
        cos, sin = _rope_angles(cos_sin_ptr, pos, rn, HEAD_DIM)
        _rope_epilogue(t, rn, n_mask, out_ptr, part_ptr, cos, sin, slot, k_cache_ptr, v_cache_ptr, q_norm_ptr,
                       k_norm_ptr, qk_eps, Q_SIZE, KV_SIZE, HEAD_DIM, QK_NORM, BLOCK_N, PARTNER)
    else:
        _store_tile(t, out_ptr, rn, n_mask, N, next_norm_ptr, normed_out_ptr, x16_out_ptr, EPILOGUE, NEXT_NORM,
                    X16_OUT, BLOCK_N)


@triton.jit
def _store_tile(total, out_ptr, rn, n_mask, N, next_norm_ptr, normed_out_ptr, x16_out_ptr, EPILOGUE: tl.constexpr,
                NEXT_NORM: tl.constexpr, X16_OUT: tl.constexpr, BLOCK_N: tl.constexpr):
    # STORE / RESIDUAL: the tile's fp16-rounded product total [BN] (fp32) stored, or added into the residual;
    # NEXT_NORM (RESIDUAL): the new residual times the next RMSNorm's weight also stored, in fp16 (the product of
    # two fp16 values is exact in fp32: one rounding, as the next GEMV's own half2 multiply would give); X16_OUT:
    # that row also in 16-bit fixed point (``store_x16``), the next GEMV's integer dot's input. The loads come
    # before the first store, which they could alias: after it, the weight's load waited for the partials
    if EPILOGUE == RESIDUAL:
        total += tl.load(out_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if NEXT_NORM:
        weight = tl.load(next_norm_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    stored = total.to(tl.float16)
    tl.store(out_ptr + rn, stored, mask=n_mask)
    if NEXT_NORM:
        normed = (stored.to(tl.float32) * weight).to(tl.float16)
        tl.store(normed_out_ptr + rn, normed, mask=n_mask)
        if X16_OUT:
            store_x16(normed.to(tl.float32), rn, N, x16_out_ptr, BLOCK_N)


@triton.jit
def split_epilogue(y, squares, pid_n, pid_k, part_ptr, squares_ptr, lock_ptr, rn, n_mask, N, splits, lock_rest,
                   out_ptr, cos_sin_ptr, pos, slot, k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr, qk_eps,
                   bias_ptr, next_norm_ptr, normed_out_ptr, x16_out_ptr, K, eps, EPILOGUE: tl.constexpr,
                   Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                   QK_NORM: tl.constexpr, BLOCK_N: tl.constexpr, PARTNER: tl.constexpr, HAS_BIAS: tl.constexpr,
                   NORM: tl.constexpr, NEXT_NORM: tl.constexpr, X16_OUT: tl.constexpr):
    # this program's partial y [BN] stored; the last of the tile's programs to arrive sums them and finishes.
    # With NORM the partials are of (weight * x) . W, and the last program scales their sum by 1 / rms(x), taken
    # from the sums of squares each split stored for its slice of x. The tail issues its loads (the squares, the
    # rotary angles, the partials) before it uses any of them, so they share one L2 round trip: reducing the
    # squares first (shuffles) held the partials' loads back until the squares had come (SASS, session 20)
    tl.store(part_ptr + pid_k.to(tl.int64) * N + rn, y, mask=n_mask)
    num_tiles = tl.num_programs(0)
    if NORM:
        tl.store(squares_ptr + pid_k * num_tiles + pid_n, squares)
    if EPILOGUE == SILU:
        counter = pid_n % (num_tiles // 2)  # gate tile c and up tile c + tiles / 2 share one counter
        arrivals = 2 * splits
    else:
        counter = pid_n
        arrivals = splits
    if last_to_arrive(lock_ptr, counter, arrivals):
        if NORM:
            part_squares = _split_squares(squares_ptr, pid_n, num_tiles, splits, SPLITS)
        else:
            part_squares = 0.0
        if EPILOGUE == SILU:
            inter = N // 2
            gate_cols = counter * BLOCK_N + tl.arange(0, BLOCK_N)
            live = gate_cols < inter
            gate = _tile_sum(part_ptr, gate_cols, live, splits, N, SPLITS, SPLITS)
            up = _tile_sum(part_ptr, gate_cols + inter, live, splits, N, SPLITS, SPLITS)
            scale = _norm_scale(part_squares, K, eps, NORM)
            gate = _rounded(gate * scale, gate_cols, live, bias_ptr, HAS_BIAS)
            up = _rounded(up * scale, gate_cols + inter, live, bias_ptr, HAS_BIAS)
            act = (gate / (1.0 + tl.exp(-gate))).to(tl.float16).to(tl.float32)
            product = (act * up).to(tl.float16)
            tl.store(out_ptr + gate_cols, product, mask=live)
            if X16_OUT:
                store_x16(product.to(tl.float32), gate_cols, inter, x16_out_ptr, BLOCK_N)
        else:
            if EPILOGUE == ROPE:  # (the angles' loads go out with the partials')
                cos, sin = _rope_angles(cos_sin_ptr, pos, rn, HEAD_DIM)
            CHUNK: tl.constexpr = 16 if EPILOGUE == ROPE and SPLITS > 16 else SPLITS  # ROPE: chunks (_tile_sum)
            total = _tile_sum(part_ptr, rn, n_mask, splits, N, SPLITS, CHUNK)
            t = _rounded(total * _norm_scale(part_squares, K, eps, NORM), rn, n_mask, bias_ptr, HAS_BIAS)
            if EPILOGUE == ROPE:
                _rope_epilogue(t, rn, n_mask, out_ptr, part_ptr, cos, sin, slot, k_cache_ptr, v_cache_ptr, q_norm_ptr,
                               k_norm_ptr, qk_eps, Q_SIZE, KV_SIZE, HEAD_DIM, QK_NORM, BLOCK_N, PARTNER)
            else:
                _store_tile(t, out_ptr, rn, n_mask, N, next_norm_ptr, normed_out_ptr, x16_out_ptr, EPILOGUE, NEXT_NORM,
                            X16_OUT, BLOCK_N)
        rearm(lock_ptr, counter, lock_rest)  # lock_rest = LOCK_PERIOD - arrivals


@triton.jit
def dot_input(x_ptr, normed_ptr, k_start, k_end, NORM: tl.constexpr, PRESCALED: tl.constexpr, EPILOGUE: tl.constexpr,
              SPLITS: tl.constexpr, NORM_BLOCK: tl.constexpr):
    # the row a GEMV's dot reads (x; PRESCALED: x * norm weight, as the previous launch's NEXT_NORM wrote it) and,
    # for a NORM launch that finishes through partials, this split's slice of x (its squares are summed in the
    # tail: ``finish_tile``)
    if PRESCALED:
        dot_ptr = normed_ptr
    else:
        dot_ptr = x_ptr
    if NORM and (SPLITS > 1 or EPILOGUE == SILU):
        x_slice = _x_slice(x_ptr, k_start, k_end, NORM_BLOCK)
    else:
        x_slice = 0.0
    return dot_ptr, x_slice


@triton.jit
def finish_tile(y, x_slice, pid_n, pid_k, x_ptr, out_ptr, part_ptr, squares_ptr, lock_ptr, cos_sin_ptr, pos,
                slot, k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr, bias_ptr, next_norm_ptr, normed_out_ptr,
                x16_out_ptr, rn, n_mask, N, K, splits, lock_rest, eps, qk_eps, NORM: tl.constexpr,
                EPILOGUE: tl.constexpr, Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                QK_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, NORM_BLOCK: tl.constexpr,
                NEXT_NORM: tl.constexpr, X16_OUT: tl.constexpr, BLOCK_N: tl.constexpr, PARTNER: tl.constexpr):
    # a GEMV program's product of its column tile, y [BN] (with NORM, of (weight * x) . W: still to be scaled
    # by 1 / rms), finished: in registers when the tile's whole sum is here (one split, not SILU), else through
    # the partials and the ticket (``x_slice``: this split's slice of x, from ``dot_input``). PARTNER
    # (ROPE): how far apart in the tile a column and its rotary partner lie, or 0 (``_partners``)
    if SPLITS == 1 and EPILOGUE != SILU:
        if NORM:
            y = y * inv_rms(x_ptr, K, eps, NORM_BLOCK)
        one_split_epilogue(y, part_ptr, rn, n_mask, N, out_ptr, cos_sin_ptr, pos, slot, k_cache_ptr, v_cache_ptr, q_norm_ptr,
                           k_norm_ptr, qk_eps, bias_ptr, next_norm_ptr, normed_out_ptr, x16_out_ptr, EPILOGUE, Q_SIZE,
                           KV_SIZE, HEAD_DIM, QK_NORM, BLOCK_N, PARTNER, HAS_BIAS, NEXT_NORM, X16_OUT)
    else:
        squares = slice_squares(x_slice) if NORM else 0.0
        split_epilogue(y, squares, pid_n, pid_k, part_ptr, squares_ptr, lock_ptr, rn, n_mask, N, splits, lock_rest,
                       out_ptr, cos_sin_ptr, pos, slot, k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr,
                       qk_eps, bias_ptr, next_norm_ptr, normed_out_ptr, x16_out_ptr, K, eps, EPILOGUE, Q_SIZE,
                       KV_SIZE, HEAD_DIM, SPLITS, QK_NORM, BLOCK_N, PARTNER, HAS_BIAS, NORM, NEXT_NORM, X16_OUT)


def norm_block(k: int, k_per_split: int, splits: int, silu: bool) -> int:
    """The NORM prologue's constexpr block: a split program sums the squares of its slice of x (``k_per_split``
    rows); a lone program without partials (one split, not SILU) reduces the whole row."""
    return next_pow2(k_per_split if splits > 1 or silu else k)


def check_prescaled(name: str, x: torch.Tensor, norm_weight, normed, residual, next_norm, n: int) -> None:
    """``normed`` goes with a norm weight and has x's shape; ``next_norm`` goes with a residual, its weight and
    output N wide; both fp16 and contiguous (the kernel reads and writes them as flat rows)."""
    if normed is not None and (norm_weight is None or normed.shape != x.shape or normed.dtype != x.dtype
                               or not normed.is_contiguous()):
        raise ValueError(f"{name}: normed {tuple(normed.shape)} needs norm_weight and x's shape "
                         f"{tuple(x.shape)}, dtype and a contiguous layout")
    if next_norm is not None:
        weight, out = next_norm
        if (residual is None or weight.shape != (n,) or out.shape != (1, n) or out.dtype != x.dtype
                or not out.is_contiguous()):
            raise ValueError(f"{name}: next_norm needs a residual, a weight [{n}] and a contiguous "
                             f"fp16 output [1, {n}]")


@dataclass(frozen=True)
class EpilogueLaunch:
    """What a one-row GEMV launch returns (``out``) and the shared tail's arguments: ``args`` the kernel's
    parameters from ``out_ptr`` to ``qk_eps`` in order, ``constexprs`` its epilogue's compile-time values and
    the launch options (PDL) that go with them."""

    out: torch.Tensor
    args: tuple
    constexprs: dict


def epilogue_launch(name: str, x: torch.Tensor, owner: torch.Tensor, n: int, block_n: int, k_per_split: int,
                    splits: int, *, norm_weight: torch.Tensor | None, eps: float, normed: torch.Tensor | None,
                    residual: torch.Tensor | None, next_norm: tuple[torch.Tensor, torch.Tensor] | None, silu: bool,
                    rope: dict | None, bias: torch.Tensor | None, rope_pairs: bool = False,
                    x16_out: torch.Tensor | None = None) -> EpilogueLaunch:
    """The outputs, scratch and arguments of a launch of ``n`` columns in ``block_n`` tiles over ``splits``
    splits of ``k_per_split`` rows of x [1, K]; ``owner`` (the weight) keeps the split-K counters and stands in
    for absent pointers. The fusions are the launchers' keyword arguments (``w4a16_gemv``); ``name`` prefixes
    the errors. A ROPE tile holds whole heads, or with ``rope_pairs`` whole rotary pairs (columns d and
    d + head_dim / 2 of a head: the kernel maps its rows so; not with Qwen3's per-head norms). ``x16_out``
    (int32 [7, width / 8]): a ``next_norm`` or ``silu`` launch also writes its row (the next norm's input, or
    silu(gate) * up) in 16-bit fixed point for the next GEMV's integer dot (``store_x16``)."""
    k = x.shape[1]
    check_prescaled(name, x, norm_weight, normed, residual, next_norm, n)
    tiles = cdiv(n, block_n)
    if block_n & (block_n - 1):
        raise ValueError(f"{name}: column tile {block_n} is not a power of two")
    head_dim = rope["head_dim"] if rope is not None else None
    epilogue, extra = STORE.value, {}
    if residual is not None:
        epilogue, out = RESIDUAL.value, residual
    elif silu:
        if n % (2 * block_n):
            raise ValueError(f"{name}: silu needs gate and up widths ({n // 2}) in whole {block_n}-tiles")
        epilogue, out = SILU.value, torch.empty((1, n // 2), dtype=x.dtype, device=x.device)
    elif rope is not None:
        if head_dim & (head_dim - 1) or n % head_dim:
            raise ValueError(f"{name}: rope needs a power-of-two head size ({head_dim}) and whole heads ({n})")
        if rope_pairs and (block_n % 2 or rope.get("q_norm") is not None):
            raise ValueError(f"{name}: rope tiles of rotary pairs need an even tile ({block_n}) and no q/k norms")
        if not rope_pairs and block_n % head_dim:
            raise ValueError(f"{name}: rope tiles ({block_n}) must hold whole heads ({head_dim})")
        epilogue, out = ROPE.value, torch.empty((1, rope["q_size"]), dtype=x.dtype, device=x.device)
        extra = rope
    else:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _check_x16_out(name, x16_out, out, block_n, next_norm is not None or silu)
    scratch = torch.empty((splits * (n + tiles),), dtype=torch.float32, device=x.device)
    part, squares = scratch[: splits * n].view(splits, n), scratch[splits * n:]  # [splits, N], [splits, tiles]
    lock = lock_buffer(owner, tiles, reuse=True, min_tiles=cdiv(n, 16))  # (a dense owner is [N, K])
    arrivals = splits * (2 if epilogue == SILU.value else 1)
    pointers = (norm_weight, extra.get("cos_sin_cache"), extra.get("positions"), extra.get("slot_mapping"),
                extra.get("k_cache"), extra.get("v_cache"), extra.get("q_norm"), extra.get("k_norm"), bias, normed,
                *(next_norm if next_norm is not None else (None, None)), x16_out)
    args = (out, part, squares, lock, *(owner if p is None else p for p in pointers), n, k, k_per_split, splits,
            LOCK_PERIOD.value - arrivals, float(eps), float(extra.get("eps", 0.0)))
    pdl = pdl_supported(x.device)
    constexprs = {
        "NORM": norm_weight is not None, "EPILOGUE": epilogue, "USE_PDL": pdl, "Q_SIZE": extra.get("q_size", 0),
        "KV_SIZE": extra.get("kv_size", 0), "HEAD_DIM": head_dim or 1, "QK_NORM": extra.get("q_norm") is not None,
        "HAS_BIAS": bias is not None, "SPLITS": next_pow2(splits),
        "NORM_BLOCK": norm_block(k, k_per_split, splits, epilogue == SILU.value) if norm_weight is not None else 1,
        "PRESCALED": normed is not None, "NEXT_NORM": next_norm is not None, "X16_OUT": x16_out is not None,
        **({"launch_pdl": True} if pdl else {}),
    }
    return EpilogueLaunch(out, args, constexprs)


def _check_x16_out(name: str, x16_out: torch.Tensor | None, out: torch.Tensor, block_n: int, writes_row: bool) -> None:
    """x16_out goes with a launch that writes the next GEMV's row (next_norm or silu), as int32 planes
    [7, width / 8] of that row, from tiles of whole 64-column blocks (a block's scale is its tile's)."""
    if x16_out is None:
        return
    width = out.shape[1]
    if not writes_row or block_n % 64 or width % 64:
        raise ValueError(f"{name}: x16_out needs next_norm or silu, tiles of whole 64-column blocks ({block_n}) "
                         f"and a row of whole blocks ({width})")
    check_x16_planes(f"{name}: x16_out", x16_out, width)


def check_x16_planes(what: str, planes: torch.Tensor, width: int) -> None:
    """``planes`` holds a row of ``width`` in 16-bit fixed point as reference.quantize_x16 lays it out: int32
    [X16_PLANES, width / 8], contiguous (the kernels index it as flat planes)."""
    if planes.shape != (X16_PLANES, width // 8) or planes.dtype != torch.int32 or not planes.is_contiguous():
        raise ValueError(f"{what} {tuple(planes.shape)} {planes.dtype} is not int32 [{X16_PLANES}, {width // 8}]")
