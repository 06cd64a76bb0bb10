"""AWQ: search per-input-channel scales (and clipping ranges) that make 4-bit rounding hurt a block the least.

Scaling input channel ``k`` of a linear layer's weight by ``s_k`` and its input by ``1/s_k`` leaves the layer
unchanged in full precision, but shrinks the relative rounding error of the weights that meet large
activations (Lin et al., 2023). The scales are ``mean|x|^alpha`` (optionally divided by the weights' own
mean relative magnitude to the power ``1 - alpha``, AutoAWQ's "duo scaling"); ``alpha`` is picked on a grid
by the mean squared error of the *block's* output on calibration activations (the attention for q/k/v,
the MLP for gate/up), so the search sees what the rounding does after the nonlinearities.

The ``1/s`` is folded into whatever produces the input: an RMSNorm's weight, or the rows of the previous
linear layer (up_proj -> down_proj, and v_proj -> o_proj; AutoAWQ does the latter only without grouped-query
attention, here the o_proj scales are tied across the query heads that read one kv head). Then, for the layers whose
outputs are not multiplied with each other (everything but q/k), a clipping range per group is searched
by the output error of that group's partial dot products.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.quant.rtn import effective_group, fake_quantize, fake_quantize_in_range, working


@dataclass
class Screen:
    """A float32 twin of a scale group (copies of its linears, the block part computed through them, its
    inputs): the grid is scored here first, at float32 matmul speed, and only near-ties are scored again in the
    float64 the quantizer computes in (``search_scales``)."""

    linears: list[nn.Linear]
    inspect: Callable[[torch.Tensor], torch.Tensor]
    inputs: torch.Tensor
    # When the block is the group's one linear layer (o_proj, down_proj): the inputs' Gram matrix X^T X [in, in].
    # The output error is then the quadratic form of the weight error, mean((X d^T)^2) = sum((d G) * d) / (T out),
    # which costs out * in^2 per grid point instead of two forwards' tokens * in * out.
    gram: torch.Tensor | None = None


@dataclass
class ScaleGroup:
    """Linear layers sharing one input, the op that produces that input, and the block part to score them by."""

    prev: nn.Module  # RMSNorm (weight [in]) or nn.Linear whose (last) output rows feed ``linears``
    linears: list[nn.Linear]
    inspect: Callable[[torch.Tensor], torch.Tensor]  # input [..., in] -> block output compared in the search
    inputs: torch.Tensor  # [..., in] full-precision calibration inputs of ``linears``
    prev_channel: torch.Tensor | None = None  # [in] output channel of ``prev`` behind each input (GQA), or None
    screen: Screen | None = None  # a float32 twin that scores the grid first (float64 searches only)
    prev_offset: float = 0.0  # a norm ``prev`` scales by ``prev_offset + weight`` (Gemma's norms: 1 + weight)


# Grid points whose float32 loss is within this fraction of the best one are scored again in float64. The
# float32 loss of a grid point is off by a few 1e-4 of itself (float32 fake quantization moves a few weights to
# the neighbouring code, then fp32 rounding in the sums), and the point that wins in float64 is in the set as long
# as the margin exceeds twice that error. That error is measured (every scale group of the default model's AWQ
# build), not proven, so the margin keeps a wide factor over it; which points enter the set differs between
# machines only for points that lose in float64 anyway. Each point in the set costs a float64 forward of the block.
SCREEN_MARGIN = 1e-2


def tie_channels(values: torch.Tensor, prev_channel: torch.Tensor | None) -> torch.Tensor:
    """Average ``values`` [in] over inputs fed by the same ``prev`` channel, so they get one scale.

    With grouped-query attention o_proj's input holds each v_proj output channel once per query head of
    its group; v_proj's row can only be divided by one number, so those o_proj columns share a scale.
    """
    if prev_channel is None:
        return values
    size = int(prev_channel.max()) + 1
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, prev_channel, values)
    counts = torch.bincount(prev_channel, minlength=size).to(values.dtype)
    return (sums / counts)[prev_channel]


@torch.no_grad()
def search_scales(group: ScaleGroup, group_size: int, n_grid: int = 20, duo_scaling: bool = True) -> torch.Tensor:
    """The best per-input-channel scales [in] for ``group``; the layers are left as they were.

    Each grid point's loss is the block output's mean squared error after 4-bit rounding of the scaled weights;
    the first point with the lowest loss wins. With a ``screen``, the float32 twin scores every point and the
    points within SCREEN_MARGIN of its best are scored again in float64, which picks the same point as scoring
    all of them in float64 (the same bytes) while scoring only the near-ties in float64 (none when one point is
    clearly best). The screen fake-quantizes in float32 too; for a one-linear block it scores from the inputs'
    Gram matrix.
    """
    x = group.inputs
    x_mean = tie_channels(working(x.abs().reshape(-1, x.shape[-1])).mean(dim=0), group.prev_channel)  # [in]
    w_mean = tie_channels(_relative_weight_mean(group.linears, group_size), group.prev_channel)  # [in]
    grid = [_grid_scales(x_mean, w_mean, step / n_grid, duo_scaling) for step in range(n_grid)]
    original = torch.cat([fc.weight.data for fc in group.linears])  # [out_total, in] (a copy)
    candidates = range(n_grid)
    if group.screen is not None:
        screen = group.screen
        grid32 = [scales.float() for scales in grid]
        if screen.gram is not None:
            num_tokens = screen.inputs.numel() // screen.inputs.shape[-1]
            losses = _gram_losses(screen.gram, num_tokens, grid32, original.float(), group_size, candidates)
        else:
            losses = _grid_losses(screen.linears, screen.inspect, screen.inputs, grid32, original.float(), group_size,
                                  candidates)
        if all(math.isfinite(loss) for loss in losses.values()):
            best = min(losses.values())
            candidates = [step for step, loss in losses.items() if loss <= best * (1 + SCREEN_MARGIN)]
    if len(candidates) == 1:
        return grid[candidates[0]]
    losses = _grid_losses(group.linears, group.inspect, x, grid, original, group_size, candidates)
    best_scales, best_loss = torch.ones_like(x_mean), float("inf")
    for step in candidates:
        if losses[step] < best_loss:
            best_loss, best_scales = losses[step], grid[step]
    return best_scales


def _grid_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float, duo_scaling: bool) -> torch.Tensor:
    """``mean|x|^alpha`` (over ``w_mean^(1 - alpha)`` with duo scaling), normalised around 1: [in]."""
    if duo_scaling:
        scales = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    else:
        scales = x_mean.pow(alpha).clamp(min=1e-4)
    scales = scales / (scales.max() * scales.min()).sqrt()
    scales[~torch.isfinite(scales)] = 1.0
    return scales


def _grid_losses(linears: list[nn.Linear], inspect: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 grid: list[torch.Tensor], original: torch.Tensor, group_size: int, steps) -> dict[int, float]:
    """Loss of each grid point in ``steps`` computed through ``linears`` (restored afterwards); ``original``
    [out_total, in] holds their full-precision weights stacked (rows are quantized independently, so one
    fake_quantize serves all of them), which the points scale and round in ``original``'s precision."""
    saved = [fc.weight.data for fc in linears]
    reference = inspect(x)
    losses = {}
    for step in steps:
        scales = grid[step]
        dense = fake_quantize(original * scales, group_size).div_(scales)  # [out_total, in]
        for fc, rows in zip(linears, dense.split([fc.out_features for fc in linears])):
            fc.weight.data = rows.to(fc.weight.dtype)
        losses[step] = working(inspect(x) - reference).pow(2).mean().item()
    for fc, w in zip(linears, saved):
        fc.weight.data = w
    return losses


def _gram_losses(gram: torch.Tensor, num_tokens: int, grid: list[torch.Tensor], original: torch.Tensor,
                 group_size: int, steps) -> dict[int, float]:
    """``_grid_losses`` of a group whose block is one linear layer, from its inputs' Gram matrix [in, in]."""
    losses = {}
    for step in steps:
        scales = grid[step]
        delta = fake_quantize(original * scales, group_size).div_(scales).sub_(original)  # [out, in]
        losses[step] = (delta @ gram).mul_(delta).sum().item() / (num_tokens * delta.shape[0])
    return losses


def _relative_weight_mean(linears: list[nn.Linear], group_size: int) -> torch.Tensor:
    """Mean over output rows of |w| / max|w| within each quantization group: [in]."""
    weight = working(torch.cat([fc.weight.data for fc in linears], dim=0))  # [out_total, in]
    g = effective_group(group_size, weight.shape[1])
    grouped = weight.abs().reshape(-1, g)
    relative = grouped / (grouped.amax(dim=1, keepdim=True) + 1e-6)
    return relative.reshape(weight.shape).mean(dim=0)


@torch.no_grad()
def apply_scales(group: ScaleGroup, scales: torch.Tensor) -> None:
    """Fold ``1/scales`` into ``prev`` and ``scales`` into the linears; divide the cached inputs too."""
    prev = group.prev
    if isinstance(prev, nn.Linear):
        prev_scales = scales
        if group.prev_channel is not None:  # tied inputs carry equal scales: one per prev output channel
            prev_scales = torch.ones(int(group.prev_channel.max()) + 1, dtype=scales.dtype, device=scales.device)
            prev_scales[group.prev_channel] = scales
        rows = prev.weight.shape[0]
        prev.weight.data[rows - prev_scales.numel():] /= prev_scales[:, None]
        if prev.bias is not None:
            prev.bias.data[rows - prev_scales.numel():] /= prev_scales
    elif group.prev_offset:  # (offset + w) / s = offset + w': w' = (offset + w) / s - offset
        prev.weight.data = (prev.weight.data + group.prev_offset) / scales - group.prev_offset
    else:
        prev.weight.data /= scales
        if getattr(prev, "bias", None) is not None:
            prev.bias.data /= scales
    for fc in group.linears:
        fc.weight.data *= scales[None, :]
    group.inputs = group.inputs / scales


@torch.no_grad()
def search_clip(weight: torch.Tensor, inputs: torch.Tensor, group_size: int, n_grid: int = 20,
                max_shrink: float = 0.5, row_chunk: int = 4096) -> torch.Tensor:
    """Per (output row, group) clipping threshold minimising the error of that group's partial outputs.

    weight: [out, in]; inputs: [..., in] -> max_val [out, n_groups]. Thresholds shrink the group's max |w|
    by steps of 1/n_grid down to (1 - max_shrink), as AutoAWQ does. AutoAWQ scores a threshold by
    ``mean_t (x_tg . (q_g - w_g))^2`` over 512 sampled tokens; that is the quadratic form of the error with
    the group's input Gram matrix ``C_g = X_g^T X_g / T``, which is computed here once from all tokens,
    so each candidate costs ``out * in * G`` instead of ``out * in * T`` and no [T, out] products are stored.
    """
    out_features, in_features = weight.shape
    g = effective_group(group_size, in_features)
    x = working(inputs.reshape(-1, in_features))
    xg = x.reshape(x.shape[0], -1, g).transpose(0, 1)  # [n_groups, tokens, G]
    gram = torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]  # [n_groups, G, G]
    results = []
    for start in range(0, out_features, row_chunk):
        w = working(weight[start:start + row_chunk])
        w = w.reshape(w.shape[0], -1, g).transpose(0, 1).contiguous()  # [n_groups, rows, G]
        wmin, wmax = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)  # [n_groups, rows, 1]
        org_max = torch.maximum(wmin.abs(), wmax)  # max |w|
        best_max = org_max.clone()
        best_err = torch.full_like(org_max, float("inf"))
        for step in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - step / n_grid)
            low = max_val.neg()
            # the clamped group's min and max are its min and max clamped: no reduction per step
            clip_min = torch.minimum(torch.maximum(wmin, low), max_val)
            clip_max = torch.minimum(torch.maximum(wmax, low), max_val)
            clipped = torch.minimum(torch.maximum(w, low), max_val)  # [n_groups, rows, G]
            delta = fake_quantize_in_range(clipped, clip_min, clip_max) - w  # [n_groups, rows, G]
            err = (torch.bmm(delta, gram) * delta).sum(dim=-1, keepdim=True)  # [n_groups, rows, 1]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, max_val, best_max)
        results.append(best_max.squeeze(-1).t())  # [rows, n_groups]
    return torch.cat(results, dim=0)


@torch.no_grad()
def apply_clip(linear: nn.Linear, max_val: torch.Tensor) -> None:
    """Clamp each (row, group) of ``linear.weight`` to [-max_val, max_val]."""
    out_features, in_features = linear.weight.shape
    g = in_features // max_val.shape[1]
    w = linear.weight.data.reshape(out_features, -1, g)
    limit = max_val[..., None].to(w.dtype)
    linear.weight.data = torch.maximum(torch.minimum(w, limit), -limit).reshape(out_features, in_features)
