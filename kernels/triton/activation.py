"""SwiGLU activation (SiLU of the gate half times the up half) in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import cdiv, next_pow2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    # x: [num_tokens, 2 * inter] (gate | up) -> out: [num_tokens, inter]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # torch rounds silu(gate) before the multiply
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2 * inter] -> [..., inter]
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} is odd")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(2048, next_pow2(inter))
        _silu_and_mul_kernel[(x2.shape[0], cdiv(inter, block))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=max(1, min(8, block // 256))
        )
    return out.reshape(*x.shape[:-1], inter)
