"""Round-to-nearest onto per-group 4-bit integer grids: the primitive shared by AWQ, GPTQ and the RTN baseline.

A group of weights is stored as integer codes ``q`` in ``0..maxq`` with one scale and one integer zero-point,
and means ``w = (q - zero) * scale``. Two ways of fitting the grid are in use and both are kept, because a
checkpoint must behave exactly like the tool it imitates:

- AutoAWQ (``fit_minmax(..., include_zero=False)``): the grid spans the group's own [min, max].
- GPTQ (``include_zero=True``): the range is widened to contain 0 first; ``sym`` puts the zero-point in the
  middle (8 for 4 bits) and makes the range symmetric.

Scales are rounded to float16 before codes are computed, since that is how they are stored: the error the
quantizer measures is then exactly the error the loaded checkpoint has.

Every function computes in the precision of its input, half types raised to float32 (``working``): the
quantizer feeds float64 so that which code, scale or clip wins does not depend on summation order (thread
count, CPU model), and the same inputs give the same bytes on any machine.
"""

from __future__ import annotations

import torch


def working(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the precision the quantizer computes in: float64 stays float64, anything else becomes float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def fit_minmax(w: torch.Tensor, maxq: int = 15, sym: bool = False, include_zero: bool = False,
               min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero-point per row of ``w`` ([rows, group]) -> (scale [rows], zero [rows]), in ``w``'s precision.

    ``min_zero`` (1 for GPTQ v1 checkpoints, which store ``zero - 1``) keeps the zero-point representable.
    """
    w = working(w)
    wmin = w.amin(dim=1)
    wmax = w.amax(dim=1)
    if include_zero:
        wmin = wmin.clamp(max=0.0)
        wmax = wmax.clamp(min=0.0)
    if sym:
        wmax = torch.maximum(wmin.abs(), wmax)
        wmin = torch.where(wmin < 0, -wmax, wmin)
    degenerate = (wmax - wmin) == 0
    wmin = torch.where(degenerate, wmin - 1.0, wmin) if include_zero else wmin
    wmax = torch.where(degenerate, wmax + 1.0, wmax) if include_zero else wmax
    scale = to_fp16_grid((wmax - wmin).clamp(min=1e-5) / maxq)
    if sym:
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        zero = (-torch.round(wmin / scale)).clamp(min_zero, maxq)
    return scale, zero


def to_fp16_grid(scale: torch.Tensor) -> torch.Tensor:
    """Round scales to the nearest positive float16 value (how checkpoints store them), kept in their precision."""
    return scale.half().to(scale.dtype).clamp(min=2.0 ** -24)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int = 15) -> torch.Tensor:
    """Codes of ``w`` on the grid; ``scale``/``zero`` broadcast against ``w``. Returns codes 0..maxq as floats."""
    return (working(w) / scale).round_().add_(zero).clamp_(0, maxq)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (codes - zero) * scale


def quantize_grouped(weight: torch.Tensor, group_size: int, maxq: int = 15, sym: bool = False,
                     include_zero: bool = False, min_zero: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain round-to-nearest of a dense weight with contiguous groups along the input dimension.

    weight: [out, in] -> (codes [out, in], scales [in // G, out], zeros [in // G, out]).
    """
    out_features, in_features = weight.shape
    g = check_group_size(group_size, in_features)
    grouped = working(weight).reshape(out_features, in_features // g, g)  # [out, n_groups, G]
    scale, zero = fit_minmax(grouped.reshape(-1, g), maxq, sym, include_zero, min_zero)
    scale = scale.reshape(out_features, -1, 1)
    zero = zero.reshape(out_features, -1, 1)
    codes = quantize_codes(grouped, scale, zero, maxq).reshape(out_features, in_features)
    return codes, scale.squeeze(-1).t().contiguous(), zero.squeeze(-1).t().contiguous()


def fake_quantize(weight: torch.Tensor, group_size: int, maxq: int = 15) -> torch.Tensor:
    """Quantize-dequantize a dense [out, in] weight on AutoAWQ's min/max grid (its ``pseudo_quantize_tensor``)."""
    out_features, in_features = weight.shape
    g = effective_group(group_size, in_features)
    grouped = working(weight).reshape(out_features, in_features // g, g)  # [out, n_groups, G]
    return fake_quantize_groups(grouped, maxq).reshape(out_features, in_features)


def fake_quantize_groups(w: torch.Tensor, maxq: int = 15) -> torch.Tensor:
    """Quantize-dequantize along the last dimension (one group per row of it), in ``w``'s precision.

    The AWQ searches call this hundreds of times per layer, so it takes few and cheap passes over the data:
    ``amax`` and ``amin`` over a 32-wide last dimension are each several times faster than one ``aminmax`` on
    CPU. Scales are not rounded to float16 here (the float16 rounding of the final codes does not change which
    scale or clip wins, and converting to float16 is slow on CPUs without F16C).
    """
    return fake_quantize_in_range(w, w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True), maxq)


def fake_quantize_in_range(w: torch.Tensor, wmin: torch.Tensor, wmax: torch.Tensor, maxq: int = 15) -> torch.Tensor:
    """``fake_quantize_groups`` given each group's min and max ([..., 1]), which a caller may already know.

    ``(clamp(round(w / s) + z, 0, maxq) - z) * s``: the codes and ``z`` are integers, so the additions are exact,
    and clamping by numbers is several times faster on CPU than by the tensors ``-z`` and ``maxq - z``.
    """
    scale = (wmax - wmin).clamp_(min=1e-5).div_(maxq)
    zero = (wmin / scale).round_().neg_().clamp_(0, maxq)
    return (w / scale).round_().add_(zero).clamp_(0, maxq).sub_(zero).mul_(scale)


def dequantize_dense(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """codes [out, in], scales/zeros [n_groups, out] -> dense [out, in] weight in the codes' precision."""
    in_features = codes.shape[1]
    groups = g_idx.long() if g_idx is not None else torch.arange(in_features, device=codes.device) // group_size
    return (codes - zeros[groups].t()) * scales[groups].t()


def effective_group(group_size: int, in_features: int) -> int:
    """Group size -1 means one group over the whole input dimension."""
    return in_features if group_size == -1 else group_size


def check_group_size(group_size: int, in_features: int) -> int:
    """The effective group size; raises when it does not divide ``in_features`` (AWQ and our kernels need that)."""
    from engine.errors import EngineError

    g = effective_group(group_size, in_features)
    if g <= 0 or in_features % g != 0:
        raise EngineError(f"group_size {group_size} does not divide in_features {in_features}; "
                          f"choose a group size that divides every linear layer's input size "
                          f"(e.g. 32 or 64), or -1 for one group per row", param="group_size")
    return g
