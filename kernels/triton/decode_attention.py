"""Paged decode attention (one query token per sequence): GQA-grouped, split-KV (flash-decoding) + reduce.

A program owns one (sequence, KV head, KV partition): it loads the KV head's whole query group once
([GROUP_PAD, D], padded to 16 rows so the scores are a tensor-core dot), streams the partition's K/V rows
through the block table (block ids cast to int64 before any pointer math) with an online softmax, and
either writes the normalised output (one partition) or an unnormalised partial plus its running max and
sum, which ``_reduce_kernel`` combines. Partitions come from the block-table width, so the launch needs
no host sync on context lengths (CUDA-graph friendly); partitions past a sequence's end write empty partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import cdiv, interpreting, next_pow2, num_sms

LOG2E = 1.4426950408889634
NO_WINDOW = 2**30  # the window bound of full attention: past any context length


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
    qk_scale,
    partition_size,
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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    P_SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)
    ctx = tl.load(context_lens + seq)
    # keys [ctx - window, ctx) are visible (window: the sliding window, or a bound past any context); a
    # partition wholly before them reads nothing
    start = tl.maximum(split * partition_size, ctx - window)
    end = tl.minimum(split * partition_size + partition_size, ctx)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows  # [GROUP_PAD] query heads of this KV head
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq64 * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [GROUP_PAD, BLOCK_D]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    bt_row = block_tables + seq64 * stride_bts
    k_head = k_cache + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache + kv_head.to(tl.int64) * stride_vh
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        t_mask = t < end
        block = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        offs = t % BLOCK_SIZE
        kv_mask = t_mask[:, None] & (d_mask[None, :] | (BLOCK_D == HEAD_DIM))  # constant along D when even
        k = tl.load(
            k_head + block[:, None] * stride_kb + offs[:, None] * stride_kt + d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            v_head + block[:, None] * stride_vb + offs[:, None] * stride_vt + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 domain
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if P_SPLIT:  # p = hi + lo in two fp16 dots: the PV product keeps ~22 bits of p (tensor cores are idle here)
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(p_hi, v) + tl.dot(p_lo, v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLIT:
        base = (seq64 * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [GROUP_PAD] partial rows
        tl.store(part_acc + base[:, None] * BLOCK_D + d[None, :], acc, mask=row_mask[:, None])
        tl.store(part_ml + base * 2, m_i, mask=row_mask)
        tl.store(part_ml + base * 2 + 1, l_i, mask=row_mask)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty context gives zeros, like the reference
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _reduce_kernel(
    part_acc,
    part_ml,
    out_ptr,
    num_splits,
    stride_os,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # partials [num_seqs * num_heads, num_splits, BLOCK_D] -> out [num_seqs, num_heads, HEAD_DIM]
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * num_heads + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    m = tl.load(part_ml + (row * num_splits + s) * 2, mask=s_mask, other=float("-inf"))
    denom = tl.load(part_ml + (row * num_splits + s) * 2 + 1, mask=s_mask, other=0.0)  # softmax sums
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_mask & (denom > 0.0), tl.exp2(m - m_max), 0.0)  # [BLOCK_S]
    acc = tl.load(
        part_acc + (row * num_splits + s)[:, None] * BLOCK_D + d[None, :],
        mask=(s_mask & (denom > 0.0))[:, None],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w * denom, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )


def _config(block_size: int, head_dim: int = 128) -> dict:
    """Keys per loop step and pipelining on a GPU: 64 keys (4 blocks of 16), 4 stages (measured best at head_dim
    128). Heads wider than 128 (Gemma's 256) take 2 stages: 4 stages of 64-key K and V tiles would need 256 KB of
    shared memory, more than a Hopper SM has (not yet timed on a GPU)."""
    if interpreting():
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_N": max(64, block_size), "num_warps": 4, "num_stages": 4 if head_dim <= 128 else 2}


def choose_partition(num_seqs: int, num_kv_heads: int, max_ctx: int, block_n: int, sms: int) -> int:
    """Tokens per KV partition: one partition when seqs x KV heads already fill the GPU, else enough
    partitions for ~4 programs per SM, each at least 4 tiles long (so the reduce stays cheap)."""
    base = num_seqs * num_kv_heads
    if base >= 2 * sms or max_ctx <= 4 * block_n:
        return max(max_ctx, 1)
    splits = min(cdiv(4 * sms, base), cdiv(max_ctx, 4 * block_n))
    return cdiv(cdiv(max_ctx, splits), block_n) * block_n


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    partition_size: int | None = None,
    config: dict | None = None,
    sliding_window: int = 0,
) -> torch.Tensor:
    # q: [num_seqs, H, D]; k_cache/v_cache: [num_blocks, block_size, KH, D]
    # block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs] -> out [num_seqs, H, D]
    # sliding_window W > 0: only the last W keys are visible
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
    group_pad = max(16, next_pow2(group))
    block_d = next_pow2(head_dim)
    cfg = dict(config or _config(block_size, head_dim))
    cfg.setdefault("P_SPLIT", False)
    block_n = cfg.pop("BLOCK_N")
    max_ctx = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = choose_partition(num_seqs, num_kv_heads, max_ctx, block_n, num_sms(q.device))
    num_splits = cdiv(max_ctx, partition_size)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            (num_seqs * num_heads * num_splits, block_d), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty((num_seqs * num_heads * num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    grid = (num_seqs, num_kv_heads, num_splits)
    _decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_acc,
        part_ml,
        scale * LOG2E,
        partition_size,
        sliding_window if sliding_window > 0 else NO_WINDOW,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_splits,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        **cfg,
    )
    if split:
        _reduce_kernel[(num_seqs, num_heads)](
            part_acc,
            part_ml,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=next_pow2(num_splits),
            num_warps=4,
        )
    return out
