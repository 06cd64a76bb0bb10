"""Paged decode attention (one query token per sequence): GQA-grouped, split-KV (flash-decoding) in one launch.

A program owns one (sequence, KV head, KV split): it loads the KV head's whole query group once
([GROUP_PAD, D], padded to 16 rows so the scores are a tensor-core dot), streams its partition's K/V rows
through the block table (block ids cast to int64 before any pointer math) with an online softmax, and either
writes the normalised output (one partition) or an unnormalised partial plus its running max and sum.

Why the split is sized inside the kernel: the grid is fixed when a CUDA graph is captured (from the
block-table width, i.e. the longest context the graph allows), but the context actually present decides how
the work should be cut. Each program reads its sequence's length and cuts the visible keys into partitions of
whole tiles, at most one per split program; programs past the last partition return at once. So a
256-token context on a graph built for 8,192 runs as a few one-tile programs instead of a few long ones.

Why no reduce kernel: inside a graph each launch costs ~1.3 us of dependency gap on Hopper. The last of a
(sequence, KV head)'s programs to store its partial (split_k.py's arrival counter, kept on the KV cache
tensor) combines the partials of every live partition and writes the output. For the same reason the kernel
takes programmatic dependent launch where the GPU has it: it is launched while the qkv kernel finishes, reads
its sequence's length and (where the KV is split) its first tile of cached keys, and waits only then for q and
the newest token's K and V, the qkv kernel's outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import (
    cdiv,
    gdc_launch_dependents,
    gdc_wait,
    interpreting,
    next_pow2,
    num_sms,
    pdl_supported,
)
from kernels.triton.split_k import LOCK_PERIOD, last_to_arrive, lock_buffer, rearm

LOG2E = 1.4426950408889634
NO_WINDOW = 2**30  # the window bound of full attention: past any context length
REDUCE_ELEMENTS = 4096  # fp32 partial elements the last program combines per step (32 registers a thread)
MIN_LOCKS = 4096  # counters made per KV cache on first use: (sequence, KV head) pairs of the largest batch


@triton.jit
def _partition(ctx, window, num_splits, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    # the visible keys [first, ctx) cut into whole tiles, at least MIN_TILES a partition, one partition per split
    # program at most -> (first key, keys per partition, live partitions >= 1)
    first = tl.maximum(ctx - window, 0)
    span = ctx - first
    size = tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N, MIN_TILES * BLOCK_N)
    return first, size, tl.maximum(tl.cdiv(span, size), 1)


@triton.jit
def _kv_rows(bt_row, t, t_mask, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE: tl.constexpr):
    # token positions t [BLOCK_N] -> their rows' offsets into the K and V caches [BLOCK_N, 1], through the block
    # table (block ids cast to int64 before any pointer math)
    block = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    offs = t % BLOCK_SIZE
    return block[:, None] * stride_kb + offs[:, None] * stride_kt, block[:, None] * stride_vb + offs[:, None] * stride_vt


@triton.jit
def _kv_tile(k_head, v_head, k_rows, v_rows, t_mask, d, d_mask, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    # the K and V rows at k_rows / v_rows -> k, v [BLOCK_N, BLOCK_D], zeros where t_mask [BLOCK_N] is off
    kv_mask = t_mask[:, None] & (d_mask[None, :] | (BLOCK_D == HEAD_DIM))  # constant along D when even
    k = tl.load(k_head + k_rows + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_head + v_rows + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _softmax_step(acc, m_i, l_i, q, k, v, t_mask, qk_scale, P_SPLIT: tl.constexpr, k_new=0.0, v_new=0.0, is_new=0.0,
                  NEWEST: tl.constexpr = False):
    # one tile of keys into the online softmax of the query group q [GROUP_PAD, BLOCK_D]: k, v [BLOCK_N, BLOCK_D].
    # NEWEST: the tile's row at is_new [BLOCK_N] (zeros in k and v) comes apart as k_new, v_new [BLOCK_D]
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 domain
    if NEWEST:  # its scores in fp32 (the dot's are fp32 sums of exact fp16 products too)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale  # [GROUP_PAD]
        s = tl.where(is_new[None, :], s_new[:, None], s)
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no key yet (an empty context) adds 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if P_SPLIT:  # p = hi + lo in two fp16 dots: the PV product keeps ~22 bits of p (tensor cores are idle here)
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        pv = tl.dot(p_hi, v) + tl.dot(p_lo, v)
    else:
        pv = tl.dot(p.to(v.dtype), v)
    if NEWEST:  # v's row is zero in the tile: its share added apart, p rounded as the dot's operand is
        p_new = tl.sum(tl.where(is_new[None, :], p, 0.0), axis=1)  # [GROUP_PAD]
        if not P_SPLIT:
            p_new = p_new.to(v.dtype).to(tl.float32)
        pv += p_new[:, None] * v_new.to(tl.float32)[None, :]
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _attend(acc, m_i, l_i, q, k_head, v_head, bt_row, start, end, stride_kb, stride_kt, stride_vb, stride_vt,
            qk_scale, d, d_mask, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr, P_SPLIT: tl.constexpr):
    # the online softmax (acc [GROUP_PAD, BLOCK_D] unnormalised, running max m in the log2 domain, sum l
    # [GROUP_PAD]) of the query group q [GROUP_PAD, BLOCK_D] carried on over the keys [start, end)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        t_mask = t < end
        k_rows, v_rows = _kv_rows(bt_row, t, t_mask, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
        k, v = _kv_tile(k_head, v_head, k_rows, v_rows, t_mask, d, d_mask, BLOCK_D, HEAD_DIM)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, t_mask, qk_scale, P_SPLIT)
    return acc, m_i, l_i


@triton.jit
def _combine_partials(part_acc, part_ml, pair_base, live, d, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                      BLOCK_D: tl.constexpr, S_CHUNK: tl.constexpr):
    # the partials of partitions [0, live) of one (sequence, KV head), rows (partition * GROUP_P2 + head) from
    # pair_base -> normalised output [GROUP_P2, BLOCK_D] fp32; S_CHUNK partitions are loaded at once
    r = tl.arange(0, S_CHUNK * GROUP_P2)  # (partition, head) flattened
    m_run = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_run = tl.zeros([GROUP_P2], tl.float32)
    acc_run = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
    for c0 in range(0, live, S_CHUNK):
        valid = ((c0 + r // GROUP_P2) < live) & (r % GROUP_P2 < GROUP)  # padding heads were never written
        row = pair_base + c0 * GROUP_P2 + r
        m = tl.reshape(tl.load(part_ml + row * 2, mask=valid, other=float("-inf"), cache_modifier=".cg"),
                       [S_CHUNK, GROUP_P2])
        l = tl.reshape(tl.load(part_ml + row * 2 + 1, mask=valid, other=0.0, cache_modifier=".cg"),
                       [S_CHUNK, GROUP_P2])
        acc = tl.reshape(tl.load(part_acc + row[:, None] * BLOCK_D + d[None, :], mask=valid[:, None], other=0.0,
                                 cache_modifier=".cg"), [S_CHUNK, GROUP_P2, BLOCK_D])
        m_new = tl.maximum(m_run, tl.max(m, axis=0))  # [GROUP_P2]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.where(l > 0.0, tl.exp2(m - m_safe[None, :]), 0.0)  # [S_CHUNK, GROUP_P2]; empty partials weigh 0
        l_run = l_run * alpha + tl.sum(w * l, axis=0)
        acc_run = acc_run * alpha[:, None] + tl.sum(acc * w[:, :, None], axis=0)
        m_run = m_new
    l_safe = tl.where(l_run == 0.0, 1.0, l_run)  # an empty context gives zeros, like the reference
    return acc_run / l_safe[:, None]


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    out_ptr,
    part_acc,
    part_ml,
    lock_ptr,
    qk_scale,
    window,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    stride_os,
    stride_oh,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    S_CHUNK: tl.constexpr,
    P_SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH_TILES: tl.constexpr = 1,
):
    # grid = (sequences, KV heads, split programs); partials [pairs * num_splits * GROUP_P2, BLOCK_D] and their
    # (max, sum) [.., 2], one row per (sequence, KV head, partition, query head). PREFETCH_TILES (with PREFETCH):
    # tiles of keys loaded before the wait, and the least a partition holds
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)
    ctx = tl.load(context_lens + seq)  # a step input: written before the previous kernel ran
    first, size, live = _partition(ctx, window, num_splits, BLOCK_N, PREFETCH_TILES if PREFETCH else 1)
    # programs past the last partition have nothing to do, and return before waiting on the previous kernel:
    # at short contexts most of the graph's split programs are idle (7B at 256 tokens: 4 live of 17 a head), and
    # waiting held their SM slots until the qkv launch ended (suspected: the default 17 splits took 7.5 us there
    # and 4 splits, the same live partitions, 6.2; bench/kernels.py --only decode1, H200, session 19)
    if split < live:
        start = first + split * size
        end = tl.minimum(start + size, ctx)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        k_head = k_cache + kv_head.to(tl.int64) * stride_kh
        v_head = v_cache + kv_head.to(tl.int64) * stride_vh
        bt_row = block_tables + seq64 * stride_bts
        if PREFETCH:
            # the first tile's keys before the newest are in the cache since earlier steps (and the block table
            # is a step input): loaded before waiting, their latency overlaps the qkv launch's tail. Only the
            # newest token's K and V (position ctx - 1) and q come from that launch: loaded after the wait as
            # rows apart, so the tile itself is ready (in shared memory for the dots) before it
            t = start + tl.arange(0, BLOCK_N)
            k_rows, v_rows = _kv_rows(bt_row, t, t < end, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
            k, v = _kv_tile(k_head, v_head, k_rows, v_rows, t < tl.minimum(end, ctx - 1), d, d_mask, BLOCK_D,
                            HEAD_DIM)
            if PREFETCH_TILES == 2:  # the second tile too: a partition of two tiles is one round trip
                t2 = t + BLOCK_N
                k_rows2, v_rows2 = _kv_rows(bt_row, t2, t2 < end, stride_kb, stride_kt, stride_vb, stride_vt,
                                            BLOCK_SIZE)
                k2, v2 = _kv_tile(k_head, v_head, k_rows2, v_rows2, t2 < tl.minimum(end, ctx - 1), d, d_mask,
                                  BLOCK_D, HEAD_DIM)
            newest = tl.maximum(ctx - 1, 0)
            is_new = (t == ctx - 1) & (t < end)  # [BLOCK_N]: at most one, in the last partition's prefetched tiles
            prefetched_end = start + PREFETCH_TILES * BLOCK_N
            new_here = (d * 0 + ((newest >= start) & (newest < end) & (newest < prefetched_end)).to(tl.int32)) > 0
            new_block = tl.load(bt_row + newest // BLOCK_SIZE).to(tl.int64)
            k_new_row = k_head + new_block * stride_kb + newest % BLOCK_SIZE * stride_kt
            v_new_row = v_head + new_block * stride_vb + newest % BLOCK_SIZE * stride_vt
        if USE_PDL:  # q and the newest K/V come from the kernel launched before this one
            gdc_wait()
            gdc_launch_dependents()
        rows = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + rows  # [GROUP_PAD] query heads of this KV head
        row_mask = rows < GROUP
        if PREFETCH:  # (a tensor mask: the interpreter mistypes scalar-bool & tensor)
            k_new = tl.load(k_new_row + d, mask=d_mask & new_here, other=0.0)  # [BLOCK_D]
            v_new = tl.load(v_new_row + d, mask=d_mask & new_here, other=0.0)
        q = tl.load(q_ptr + seq64 * stride_qs + heads[:, None] * stride_qh + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, BLOCK_D]
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        rest = start
        if PREFETCH:  # the prefetched tiles into the softmax, the newest row apart
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, t < end, qk_scale, P_SPLIT, k_new, v_new, is_new,
                                          True)
            if PREFETCH_TILES == 2:
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k2, v2, t2 < end, qk_scale, P_SPLIT, k_new, v_new,
                                              (t2 == ctx - 1) & (t2 < end), True)
            rest = prefetched_end
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, bt_row, rest, end, stride_kb, stride_kt,
                                stride_vb, stride_vt, qk_scale, d, d_mask, BLOCK_D, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                                P_SPLIT)
        out_rows = out_ptr + seq64 * stride_os
        if live == 1:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty context gives zeros, like the reference
            tl.store(out_rows + heads[:, None] * stride_oh + d[None, :],
                     (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
        elif SPLIT:
            pair = seq64 * tl.num_programs(1) + kv_head
            pair_base = pair * num_splits * GROUP_P2
            part = pair_base + split * GROUP_P2 + rows  # [GROUP_PAD] partial rows
            tl.store(part_acc + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_mask[:, None])
            tl.store(part_ml + part * 2, m_i, mask=row_mask)
            tl.store(part_ml + part * 2 + 1, l_i, mask=row_mask)
            if last_to_arrive(lock_ptr, pair, live):
                out = _combine_partials(part_acc, part_ml, pair_base, live, d, GROUP, GROUP_P2, BLOCK_D, S_CHUNK)
                g = tl.arange(0, GROUP_P2)
                tl.store(out_rows + (kv_head * GROUP + g)[:, None] * stride_oh + d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & d_mask[None, :])
                rearm(lock_ptr, pair, (live * 0 + LOCK_PERIOD) - live)  # (tensor arithmetic: the interpreter)


FEW_PAIRS_TILE = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 1}


def has_few_pairs(pairs: int, sms: int) -> bool:
    """Whether a launch's (sequence, KV head) pairs fill at most a quarter of the SMs (batch-1 decode of every
    catalog model): there each program's time is the launch's, and it is set by its memory round trips, not by
    how many programs share an SM."""
    return 4 * pairs <= sms


def _config(block_size: int, head_dim: int = 128, few_pairs: bool = False) -> dict:
    """Keys per loop step and pipelining on a GPU: 64 keys (4 blocks of 16), 4 stages (measured best at head_dim
    128). With few pairs (``has_few_pairs``) a program takes 128 keys a step over 8 warps, unpipelined: a
    partition's keys arrive in one round trip instead of two, and at 128 keys no partials are combined (H100,
    batch 1, 32/8 heads: 4.98 -> 3.19 us at 128 keys, 5.96 -> 5.43 at 1,024; 9/3 heads of 64: 5.48 -> 2.80,
    7.93 -> 5.43 at 2,048; bench/kernels.py --only decode1, session 29; batch-1 decode +1.9% on the 7B, +2.1% on
    the 8B, +6.1% on SmolLM2, session 30). Heads wider than 128 (Gemma's 256) take 64 keys and 2 stages: 4
    stages of 64-key K and V tiles, or one of 128 keys, would need 256 KB of shared memory, more than a Hopper SM
    has (not yet timed on a GPU). ``PREFETCH_TILES: 2`` in a config (not in any rule yet) loads a program's
    first two tiles before the wait and gives each partition two at least: at 129-256 keys a head then takes one
    partition instead of two and a combine step (7B at batch 1: 3.81 us at 128 keys, 6.40 at 256 with the
    combine; H100, session 33). Compiled for sm_90 it holds 225-229 registers at head size 128, no spills."""
    if interpreting():
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if few_pairs and head_dim <= 128:
        return {**FEW_PAIRS_TILE, "BLOCK_N": max(FEW_PAIRS_TILE["BLOCK_N"], block_size)}
    return {"BLOCK_N": max(64, block_size), "num_warps": 4, "num_stages": 4 if head_dim <= 128 else 2}


def reduce_chunk(group: int, block_d: int) -> int:
    """Partitions the last program combines per step: REDUCE_ELEMENTS fp32 values of partial outputs."""
    return max(1, REDUCE_ELEMENTS // (next_pow2(group) * block_d))


def prefetches_first_tile(split: bool, block_d: int) -> bool:
    """Whether a program loads its first tile of keys before waiting on the previous kernel. That tile is held
    through the wait (at head size 128 with the KV split: 128 registers a thread against 110 under Triton 3.6,
    183 against 100 under 3.9; at 256 it would spill), so only where the KV is split: few (sequence, KV head)
    pairs, a launch bound by latency, not by occupancy."""
    return split and block_d <= 128


def choose_splits(num_seqs: int, num_kv_heads: int, max_ctx: int, block_n: int, sms: int, chunk: int) -> int:
    """Split programs per (sequence, KV head): one when seqs x KV heads already fill the GPU, else enough for
    ~4 programs per SM, at most one per tile of the longest context and two reduce steps of partitions. The last
    program combines the partials a chunk at a time, a memory round trip each: on the 8B (GQA 32/8, a chunk of 8)
    at batch 1 and 2,048 tokens, 32 partitions of 64 keys (4 steps) took 9.86 us and 16 of 128 took 8.41, and at
    256-1,024 tokens 16 split programs cut the keys as the fastest fixed split did (bench/kernels.py --only
    decode1, H200, session 19). MHA's chunk of 32 partitions never binds."""
    base = num_seqs * num_kv_heads
    if base >= 2 * sms or max_ctx <= block_n:
        return 1
    return max(1, min(cdiv(4 * sms, base), cdiv(max_ctx, block_n), 2 * chunk))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: dict | None = None,
    sliding_window: int = 0,
) -> torch.Tensor:
    # q: [num_seqs, H, D]; k_cache/v_cache: [num_blocks, block_size, KH, D]
    # block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs] -> out [num_seqs, H, D]
    # sliding_window W > 0: only the last W keys are visible. num_splits: split programs per (sequence, KV
    # head), chosen from the device and the block-table width unless given
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError("paged_decode_attention: block_tables/context_lens rows != num_seqs")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention: cache head_dim must be contiguous")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_p2 = next_pow2(group)
    block_d = next_pow2(head_dim)
    pairs = num_seqs * num_kv_heads
    sms = num_sms(q.device)
    cfg = dict(config or _config(block_size, head_dim, has_few_pairs(pairs, sms)))
    cfg.setdefault("P_SPLIT", False)
    block_n = cfg.pop("BLOCK_N")
    chunk = cfg.pop("S_CHUNK", reduce_chunk(group, block_d))
    if num_splits is None:
        num_splits = choose_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size, block_n, sms, chunk)
    split = num_splits > 1
    cfg.setdefault("PREFETCH", prefetches_first_tile(split, block_d))
    if split:
        part_acc = torch.empty((pairs * num_splits * group_p2, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((pairs * num_splits * group_p2, 2), dtype=torch.float32, device=q.device)
        lock = lock_buffer(k_cache, pairs, reuse=True, min_tiles=MIN_LOCKS)
    else:
        part_acc = part_ml = lock = out  # unused
    pdl = pdl_supported(q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml, lock, scale * LOG2E,
        sliding_window if sliding_window > 0 else NO_WINDOW,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), num_splits,
        GROUP=group, GROUP_PAD=max(16, group_p2), GROUP_P2=group_p2, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split, S_CHUNK=chunk, USE_PDL=pdl, **cfg,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
