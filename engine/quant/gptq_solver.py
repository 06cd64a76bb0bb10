"""GPTQ: quantize one weight matrix column by column, pushing each column's rounding error onto the rest.

The layer's output error for inputs X is ``||(W - Q) X^T||^2``, a quadratic form in the Hessian
``H = 2 X^T X / N`` (``[in, in]``, accumulated by ``HessianAccumulator`` from calibration inputs). Quantizing
column ``i`` and then updating the not-yet-quantized columns by ``-err_i * Hinv[i, i:] / Hinv[i, i]`` is the
optimal (OBS) correction; the upper Cholesky factor of ``H^-1`` gives every row of that update at once.
Columns are processed in blocks so most of the update is one matmul (Frantar et al., 2022).

Act-order (``desc_act``) processes columns by decreasing ``diag(H)`` (the most activated inputs first,
while there is the most freedom left to compensate them). Groups are then formed in that order, which
is what ``g_idx`` records: ``g_idx[c]`` is the group of input column ``c``.

Rows are independent given ``H``, so layers that share an input (q/k/v, gate/up) are solved as one
stacked matrix: identical results, fewer Python-level column steps, and one shared act-order permutation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.quant.rtn import effective_group, fit_minmax, quantize_codes, working


class HessianAccumulator:
    """Running ``H = 2/N * sum x x^T`` over calibration tokens of one linear input (float64 inputs: float64 H)."""

    def __init__(self, in_features: int, device: torch.device | str, dtype: torch.dtype = torch.float32):
        self.hessian = torch.zeros(in_features, in_features, dtype=dtype, device=device)  # [in, in]
        self.num_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.hessian.dtype)  # [tokens, in]
        n = x.shape[0]
        total = self.num_tokens + n
        self.hessian.mul_(self.num_tokens / total)
        self.hessian.addmm_(x.t(), x, alpha=2.0 / total)
        self.num_tokens = total


@dataclass
class GPTQResult:
    """codes [out, in] (original column order); scales, zeros [n_groups, out]; g_idx [in] int32; floats in the
    solver's precision."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """Dense [out, in] weight."""
        groups = self.g_idx.long()
        return (self.codes - self.zeros[groups].t()) * self.scales[groups].t()


@dataclass(frozen=True)
class GPTQConfig:
    group_size: int = 128
    sym: bool = False
    desc_act: bool = False
    damp_percent: float = 0.01
    block_size: int = 128
    maxq: int = 15
    min_zero: int = 0  # 1 when writing v1 checkpoints (zero - 1 is stored and must stay >= 0)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, cfg: GPTQConfig) -> GPTQResult:
    """Quantize ``weight`` [out, in] given the input Hessian [in, in]; neither argument is modified."""
    with _single_threaded_on_cpu(weight.device):
        return _gptq_quantize(weight, hessian, cfg)


@contextmanager
def _single_threaded_on_cpu(device: torch.device) -> Iterator[None]:
    """The column loop is thousands of tiny ops: on CPU, OpenMP hand-offs cost more than they save.

    Measured on the 2-core CI box, a [960, 576] layer: 0.14 s with one thread, 0.6-2.8 s with two.
    """
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, cfg: GPTQConfig) -> GPTQResult:
    dtype = torch.promote_types(working(weight).dtype, working(hessian).dtype)
    w = weight.detach().to(dtype, copy=True)  # [out, in]
    h = hessian.detach().to(dtype, copy=True)
    _out_features, in_features = w.shape
    group = effective_group(cfg.group_size, in_features)

    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    perm = torch.argsort(torch.diag(h), descending=True) if cfg.desc_act else None
    if perm is not None:
        w = w[:, perm]
        h = h[perm][:, perm]
    hinv = _inverse_cholesky_upper(h, cfg.damp_percent)  # [in, in]

    # The loop walks the input columns of ``w``; it keeps them as contiguous rows of the transpose (same
    # arithmetic, element by element, as column slices; the block update's matmul keeps its operand order).
    wt = w.t().contiguous()  # [in, out]
    codes = torch.zeros_like(wt)  # [in, out]
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    scale = zero = None
    for i1 in range(0, in_features, cfg.block_size):
        i2 = min(i1 + cfg.block_size, in_features)
        w1 = wt[i1:i2].clone()  # [block, out]
        err1 = torch.zeros(w1.shape[1], i2 - i1, dtype=w1.dtype, device=w1.device)  # [out, block]
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group == 0:
                # Fit the group's grid on the error-compensated weights as they are now (GPTQ does the same).
                block = w1[i:i + group]  # [group, out]; a group may run past the block into wt
                if block.shape[0] < group:
                    block = torch.cat([block, wt[i2:i2 + group - block.shape[0]]], dim=0)
                scale, zero = fit_minmax(block.t(), cfg.maxq, cfg.sym, include_zero=True, min_zero=cfg.min_zero)
                scales.append(scale)
                zeros.append(zero)
            q = quantize_codes(w1[i], scale, zero, cfg.maxq)  # [out]
            codes[col] = q
            err = (w1[i] - (q - zero) * scale) / hinv1[i, i]
            w1[i:] -= hinv1[i, i:, None] * err[None, :]
            err1[:, i] = err
        wt[i2:] -= (err1 @ hinv[i1:i2, i2:]).t()

    codes = codes.t()  # [out, in]
    g_idx = torch.arange(in_features, device=w.device) // group
    if perm is not None:
        invperm = torch.argsort(perm)
        codes = codes[:, invperm]
        g_idx = g_idx[invperm]
    return GPTQResult(codes.contiguous(), torch.stack(scales), torch.stack(zeros), g_idx.to(torch.int32))


def _inverse_cholesky_upper(h: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper Cholesky factor of the dampened ``H^-1``; retries with more dampening if H is not positive definite."""
    damp = damp_percent * torch.mean(torch.diag(h))
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for attempt in range(6):
        try:
            chol = torch.linalg.cholesky(h + (damp * 10 ** attempt) * eye)
            return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
        except torch.linalg.LinAlgError:
            continue
    raise RuntimeError("GPTQ: the calibration Hessian is not positive definite even with heavy dampening")
