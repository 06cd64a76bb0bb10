"""Writes new K/V rows into their paged-cache slots (one program per token; padding slots < 0 skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import next_pow2


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache,
    v_cache,
    slot_ptr,
    num_kv_heads,
    head_dim,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # key/value: [T, KH, D] -> k_cache/v_cache[block, offset] : [KH, D]
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot  # full tile: the interpreter rejects scalar masks
    mask = (heads[:, None] < num_kv_heads) & (d[None, :] < head_dim) & (slots >= 0)
    k = tl.load(key_ptr + tok * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
    kdst = k_cache + block * stride_kcb + offset * stride_kct + heads[:, None] * stride_kch + d[None, :]
    vdst = v_cache + block * stride_vcb + offset * stride_vct + heads[:, None] * stride_vch + d[None, :]
    tl.store(kdst, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(vdst, v.to(v_cache.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # key, value: [T, KH, D]; k_cache, v_cache: [num_blocks, block_size, KH, D]; slot_mapping: [T]
    num_tokens, num_kv_heads, head_dim = key.shape
    if (
        value.shape != key.shape
        or k_cache.shape != v_cache.shape
        or k_cache.shape[2:] != (num_kv_heads, head_dim)
    ):
        raise ValueError(
            f"reshape_and_cache: key {tuple(key.shape)}, value {tuple(value.shape)}, "
            f"cache {tuple(k_cache.shape)} disagree"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError("reshape_and_cache: slot_mapping length != number of tokens")
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("reshape_and_cache: cache head_dim must be contiguous")
    if num_tokens == 0:
        return
    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
