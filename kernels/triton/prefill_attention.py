"""Causal attention of ragged query chunks over paged KV: prefill, chunked prefill and prefix-cache hits.

Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, the last ``q_len`` tokens of its
``context_lens[i]``-token context; its KV (cached prefix + the new tokens, already written by
``reshape_and_cache``) is read through its block table. A program owns (query tile of one sequence, query
head). The grid is sized from the token count without a host sync: ``cdiv(T, BLOCK_M) + num_seqs`` tiles
bound the per-sequence tile count, and each program finds its sequence from a prefix sum of tile counts.
Key tiles wholly below the tile's first query position skip the causal mask; only the diagonal tiles pay it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import cdiv, interpreting, next_pow2

LOG2E = 1.4426950408889634
NO_WINDOW = 2**30  # the window bound of full attention: past any context length


@triton.jit
def _attn_tile(
    acc,
    m_i,
    l_i,
    q,
    k_head,
    v_head,
    bt_row,
    k_lo,
    k_hi,
    q_pos,
    d,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    s_scale,
    window,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    # keys [k_lo, k_hi); unmasked tiles (MASKED False) are whole BLOCK_N tiles every query row may see;
    # masked ones apply causality and the sliding window (a key at t is visible to q_pos - window < t <= q_pos)
    for t0 in range(k_lo, k_hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        offs = t % BLOCK_SIZE
        if MASKED:
            t_mask = t < k_hi
            block = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
            kv_mask = t_mask[:, None] & (d[None, :] < HEAD_DIM)
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
        else:
            block = tl.load(bt_row + t // BLOCK_SIZE).to(tl.int64)
            if BLOCK_D == HEAD_DIM:
                k = tl.load(k_head + block[:, None] * stride_kb + offs[:, None] * stride_kt + d[None, :])
                v = tl.load(v_head + block[:, None] * stride_vb + offs[:, None] * stride_vt + d[None, :])
            else:
                k = tl.load(
                    k_head + block[:, None] * stride_kb + offs[:, None] * stride_kt + d[None, :],
                    mask=d[None, :] < HEAD_DIM,
                    other=0.0,
                )
                v = tl.load(
                    v_head + block[:, None] * stride_vb + offs[:, None] * stride_vt + d[None, :],
                    mask=d[None, :] < HEAD_DIM,
                    other=0.0,
                )
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32 q.k (times s_scale: log2 domain)
        if MASKED:
            visible = (t[None, :] <= q_pos[:, None]) & (t[None, :] > q_pos[:, None] - window) & t_mask[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * s_scale)
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        else:
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s * s_scale - m_use[:, None])  # one FFMA: the scale rides on the max subtraction
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


# num_seqs and the block-table row stride (the step's widest table) change every eager step and only bound
# loops and offsets: not specialized, so one binary serves every step of a sequence bucket (seq_block).
@triton.jit(do_not_specialize=["num_seqs", "stride_bts"])
def _prefill_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    context_lens,
    out_ptr,
    qk_scale,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PRESCALE_Q: tl.constexpr,
):
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # last tiles (longest causal rows) start first
    head = tl.program_id(1)
    # which sequence owns tile ``pid``: prefix sum of per-sequence tile counts
    s_idx = tl.arange(0, BLOCK_S)
    s_mask = s_idx < num_seqs
    q_starts = tl.load(query_start_loc + s_idx, mask=s_mask, other=0)
    q_ends = tl.load(query_start_loc + s_idx + 1, mask=s_mask, other=0)
    n_tiles = (q_ends - q_starts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(n_tiles, axis=0)
    seq = tl.sum((tiles_end <= pid).to(tl.int32), axis=0)
    valid = seq < num_seqs
    seq = tl.minimum(seq, num_seqs - 1)
    tile = pid - tl.sum(tl.where(s_idx == seq, tiles_end - n_tiles, 0), axis=0)

    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    ctx = tl.load(context_lens + seq)
    prefix = ctx - q_len  # cached tokens before the first query row
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows within the sequence's chunk
    row_mask = rows < tl.where(valid, q_len, 0)  # (no scalar-bool & tensor: the interpreter mistypes it)
    q_pos = prefix + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if PRESCALE_Q:  # the old way, kept for bench/numerics.py: q * scale * log2 e rounded to fp16 once
        q = (q.to(tl.float32) * qk_scale).to(q.dtype)
        s_scale = 1.0
    else:  # scores stay exact fp32 dot products; the scale is applied in fp32 (bench/numerics.py)
        s_scale = qk_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_head = (head // GROUP).to(tl.int64)
    k_head = k_cache + kv_head * stride_kh
    v_head = v_cache + kv_head * stride_vh
    bt_row = block_tables + seq.to(tl.int64) * stride_bts
    first_pos = prefix + tile * BLOCK_M
    last_pos = tl.minimum(first_pos + BLOCK_M, ctx)  # one past the last key any row of the tile sees
    last_pos = tl.where(valid, last_pos, 0)
    full_end = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, last_pos)  # no key past any row's position
    # with a sliding window: keys before the first row's window are skipped, and only the tiles past the last
    # row's window start are free of the window mask (window is a bound past any context without one)
    win_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    win_hi = tl.minimum(tl.maximum(tl.cdiv(last_pos - window, BLOCK_N) * BLOCK_N, win_lo), full_end)
    acc, m_i, l_i = _attn_tile(
        acc,
        m_i,
        l_i,
        q,
        k_head,
        v_head,
        bt_row,
        win_lo,
        win_hi,
        q_pos,
        d,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        s_scale,
        window,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_SIZE,
        BLOCK_N,
        True,
    )
    acc, m_i, l_i = _attn_tile(
        acc,
        m_i,
        l_i,
        q,
        k_head,
        v_head,
        bt_row,
        win_hi,
        full_end,
        q_pos,
        d,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        s_scale,
        window,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_SIZE,
        BLOCK_N,
        False,
    )
    acc, m_i, l_i = _attn_tile(
        acc,
        m_i,
        l_i,
        q,
        k_head,
        v_head,
        bt_row,
        full_end,
        last_pos,
        q_pos,
        d,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        s_scale,
        window,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_SIZE,
        BLOCK_N,
        True,
    )
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _config(head_dim: int, device: torch.device) -> dict:
    """Tile shape: small under the interpreter; on a GPU 128x128, 8 warps, 3 stages (measured best)."""
    if interpreting() or device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if head_dim > 128:  # Gemma's 256: 128 x 128 tiles in 3 stages would not fit in shared memory (not yet timed)
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


SEQ_BLOCK_FLOOR = 64  # smallest BLOCK_S: steps of 1 .. 64 sequences share one compiled kernel


def seq_block(num_seqs: int) -> int:
    """BLOCK_S for ``num_seqs`` sequences: the lanes that find each query tile's sequence. Buckets from
    SEQ_BLOCK_FLOOR up, so an engine meets at most log2(max_num_seqs / 64) + 1 variants (warmed at start-up);
    64 lanes of prefix sum cost nothing next to a tile of attention."""
    return max(SEQ_BLOCK_FLOOR, next_pow2(num_seqs))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    config: dict | None = None,
    sliding_window: int = 0,
) -> torch.Tensor:
    # q: [T, H, D]; caches: [num_blocks, block_size, KH, D]; block_tables: [S, max_blocks];
    # query_start_loc: [S + 1]; context_lens: [S] -> out [T, H, D]; sliding_window W > 0: keys within W
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError("paged_attention: query_start_loc/block_tables do not match context_lens")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: cache head_dim must be contiguous")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = dict(config or _config(head_dim, q.device))
    cfg.setdefault("PRESCALE_Q", False)
    grid = (cdiv(num_tokens, cfg["BLOCK_M"]) + num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * LOG2E,
        sliding_window if sliding_window > 0 else NO_WINDOW,
        num_seqs,
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
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_S=seq_block(num_seqs),
        **cfg,
    )
    return out
