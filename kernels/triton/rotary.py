"""Neox-style (rotate-half) rotary embedding of q and k, one program per token covering all its heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import next_pow2


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    tok,
    num_heads,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    cos,
    sin,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # src/dst rows: [num_heads, 2 * half]; cos/sin: [BLOCK_HALF] float32
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (d[None, :] < half)
    src = src_ptr + tok * stride_st + heads[:, None] * stride_sh + d[None, :]
    dst = dst_ptr + tok * stride_dt + heads[:, None] * stride_dh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(dst, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(dst + half, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_out,
    k_out,
    num_heads,
    num_kv_heads,
    half,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=d < half, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + d, mask=d < half, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr,
        q_out,
        tok,
        num_heads,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        cos,
        sin,
        half,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out,
        tok,
        num_kv_heads,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        cos,
        sin,
        half,
        BLOCK_KH,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [T]; q: [T, H, D]; k: [T, KH, D]; cos_sin_cache: [max_pos, D] fp32 -> new (q, k)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rotary_embedding: bad q {tuple(q.shape)} / k {tuple(k.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if head_dim % 2 or cos_sin_cache.shape[-1] != head_dim or positions.shape[0] != num_tokens:
        raise ValueError("rotary_embedding: head_dim, cos_sin_cache and positions disagree")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens > 0:
        half = head_dim // 2
        block_h = next_pow2(num_heads)
        _rotary_kernel[(num_tokens,)](
            positions,
            q,
            k,
            cache,
            q_out,
            k_out,
            num_heads,
            k.shape[1],
            half,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cache.stride(0),
            BLOCK_H=block_h,
            BLOCK_KH=next_pow2(k.shape[1]),
            BLOCK_HALF=next_pow2(half),
            num_warps=4 if block_h * half >= 1024 else 1,
        )
    return q_out, k_out
