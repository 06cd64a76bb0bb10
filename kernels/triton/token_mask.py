"""Grammar bitmask applied to the logits in one pass (structured outputs, engine/structured_output.py).

The packed mask is llguidance's layout: bit ``i % 32`` of int32 word ``i // 32`` is set when token ``i`` is
allowed. Unpacking it with torch ops (shift, and, compare, masked_fill) was four to six launches and ~300 us of
host time a step at 32 rows (BENCHMARKS.md, issue 17); this kernel reads each word once per 32 logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import cdiv

_BLOCK = 1024


@triton.jit
def _masked_logits_kernel(logits_ptr, bits_ptr, out_ptr, vocab, words, stride_logits, stride_bits, stride_out,
                          BLOCK: tl.constexpr):
    # logits: [rows, vocab] fp32; bits: [rows, words] int32 -> out: [rows, vocab], -inf where the bit is clear
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    word_index = cols // 32
    word = tl.load(bits_ptr + row * stride_bits + word_index, mask=inside & (word_index < words), other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0  # an arithmetic shift of bit 31 still ends in ...1 after the and
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=inside, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, tl.where(allowed, x, float("-inf")), mask=inside)


def masked_logits(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """A new ``logits`` [rows, vocab] with each row's disallowed tokens at -inf; ``bits`` [rows, words] int32.
    Tokens past ``32 * words`` are disallowed (the model has more logits than the grammar's vocabulary)."""
    if logits.dim() != 2 or bits.dim() != 2 or bits.shape[0] != logits.shape[0] or bits.dtype != torch.int32:
        raise ValueError(f"masked_logits: logits {tuple(logits.shape)} and int32 bits [rows, words] "
                         f"{tuple(bits.shape)} {bits.dtype} do not match")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if bits.stride(-1) != 1:
        bits = bits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if rows and vocab:
        _masked_logits_kernel[(rows, cdiv(vocab, _BLOCK))](
            logits, bits, out, vocab, bits.shape[1], logits.stride(0), bits.stride(0), out.stride(0),
            BLOCK=_BLOCK, num_warps=4)
    return out
