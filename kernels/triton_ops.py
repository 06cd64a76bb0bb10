"""The Triton op table: each public function has the signature and semantics of its namesake in reference.py.

Launchers only (check shapes, allocate outputs, launch); the kernels live in ``kernels/triton/<family>.py``.
Shapes:
  rms_norm            x, residual [T, hidden]; weight [hidden] -> (out [T, hidden], new_residual [T, hidden])
  silu_and_mul        x [T, 2 * inter] -> [T, inter]
  rotary_embedding    positions [T]; q [T, H, D]; k [T, KH, D]; cos_sin_cache [max_pos, D] fp32 -> (q, k)
  reshape_and_cache   key, value [T, KH, D] -> k_cache, v_cache [num_blocks, block_size, KH, D]
                      at slot_mapping [T]
  paged_attention     q [T, H, D]; block_tables [S, max_blocks]; query_start_loc [S + 1]; context_lens [S]
                      -> [T, H, D]  (ragged causal chunks over cached prefix + themselves; sliding_window W > 0:
                      keys within W positions of the query only)
  paged_decode_attention  q [S, H, D]; block_tables [S, max_blocks]; context_lens [S] -> [S, H, D]
  w4a16_matmul        x [M, K]; qweight [K // 8, N] int32; scales, zeros [K // G, N]; perm [K] | None
                      -> [M, N]
  w4a16_gemv          x [1, K] and the same weights, with a fused RMSNorm before and a residual add, SiLU x up
                      or rotary + KV-cache write after (reference.w4a16_gemv) -> [1, N], [1, N // 2] or q
  dense_gemv          x [1, K]; weight [N, K] fp16 (a Linear's own): w4a16_gemv's fusions around x @ weight^T;
                      or int8 with row_scales [N] (the int8 LM head)
  w8a16_matmul        x [M, K]; qweight [N, K] int8; row_scales [N] -> [M, N]
  masked_logits       logits [rows, vocab] fp32; bits [rows, ceil(vocab / 32)] int32 (packed grammar mask)
                      -> [rows, vocab], -inf where the bit is clear
"""

from __future__ import annotations

import torch

from kernels.triton import (
    activation,
    cache,
    decode_attention,
    norm,
    prefill_attention,
    rotary,
    token_mask,
    w4a16,
    w8a16,
)
from kernels.triton import dense_gemv as dense
from kernels.triton import w4a16_gemv as gemv


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm.rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return activation.silu_and_mul(x)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary.rotary_embedding(positions, q, k, cos_sin_cache)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    cache.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    return prefill_attention.prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window=sliding_window
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    return decode_attention.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                             sliding_window=sliding_window)


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    return w4a16.w4a16_matmul(x, qweight, scales, zeros, group_size, perm)


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               perm: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               normed: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               next_norm: tuple[torch.Tensor, torch.Tensor] | None = None, silu: bool = False,
               rope: dict | None = None, bias: torch.Tensor | None = None, x16: torch.Tensor | None = None,
               x16_out: torch.Tensor | None = None) -> torch.Tensor:
    return gemv.w4a16_gemv(x, qweight, scales, zeros, group_size, perm, norm_weight=norm_weight, eps=eps,
                           normed=normed, residual=residual, next_norm=next_norm, silu=silu, rope=rope, bias=bias,
                           x16=x16, x16_out=x16_out)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               normed: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               next_norm: tuple[torch.Tensor, torch.Tensor] | None = None, silu: bool = False,
               rope: dict | None = None, bias: torch.Tensor | None = None,
               row_scales: torch.Tensor | None = None) -> torch.Tensor:
    return dense.dense_gemv(x, weight, norm_weight=norm_weight, eps=eps, normed=normed, residual=residual,
                            next_norm=next_norm, silu=silu, rope=rope, bias=bias, row_scales=row_scales)


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    return w8a16.w8a16_matmul(x, qweight, row_scales)


def masked_logits(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    return token_mask.masked_logits(logits, bits)

