"""Fused RMSNorm with an optional residual add: one read of x (and residual), one write of each output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per token row: x, residual [hidden] -> out [hidden], new_residual [hidden]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's x + residual
        tl.store(new_res_ptr + row * stride_nr + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)  # HF rounds to the input dtype before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [num_tokens, hidden]; weight: [hidden] -> (out [num_tokens, hidden], new_residual)
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden {hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_res = torch.empty_like(x2, memory_format=torch.contiguous_format)
    else:
        r2, new_res = x2, x2
    rows = x2.shape[0]
    if rows > 0:
        block = next_pow2(hidden)
        num_warps = min(16, max(1, block // 512))
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            new_res,
            hidden,
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_res.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    new_residual = new_res.reshape(x.shape) if residual is not None else x
    return out.reshape(x.shape), new_residual
