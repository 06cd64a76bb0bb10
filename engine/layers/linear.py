"""Linear layers whose weights are dense or packed int4 (W4A16), with a merged form for qkv and gate/up."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ops import Backend


@dataclass
class PackedInt4:
    """A 4-bit weight in the kernel layout of kernels/reference.py (one layout for AWQ and GPTQ).

    qweight: [K // 8, N] int32; scales, zeros: [K // group_size, N] activation dtype;
    perm: [K] int64 or None (GPTQ act-order: rows reordered at load so groups are contiguous; y = x[:, perm] @ W).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * 8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "PackedInt4":
        perm = None if self.perm is None else self.perm.to(device)
        return PackedInt4(self.qweight.to(device), self.scales.to(device, dtype), self.zeros.to(device, dtype),
                          self.group_size, perm)

    def nbytes(self) -> int:
        parts = [self.qweight, self.scales, self.zeros] + ([self.perm] if self.perm is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    @staticmethod
    def can_concat(parts: list["PackedInt4"]) -> bool:
        first = parts[0]
        return all(p.group_size == first.group_size and p.in_features == first.in_features
                   and _same_perm(p.perm, first.perm) for p in parts)

    @staticmethod
    def concat(parts: list["PackedInt4"]) -> "PackedInt4":
        """Stack along the output dimension (q, k, v -> qkv). Caller checks ``can_concat`` first."""
        return PackedInt4(torch.cat([p.qweight for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1),
                          torch.cat([p.zeros for p in parts], dim=1), parts[0].group_size, parts[0].perm)


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


Weight = torch.Tensor | PackedInt4


class Linear:
    """y = x @ W^T (+ bias). Dense weights are [out, in]; packed ones go through the W4A16 kernel.

    ``parts`` holds several weights when a merged layer (qkv, gate/up) could not be concatenated
    (e.g. GPTQ act-order with different permutations); their outputs are concatenated.
    """

    def __init__(self, parts: list[Weight], bias: torch.Tensor | None, backend: Backend):
        if len(parts) > 1 and all(isinstance(p, torch.Tensor) for p in parts):
            parts = [torch.cat(parts, dim=0)]
        elif len(parts) > 1 and all(isinstance(p, PackedInt4) for p in parts) and PackedInt4.can_concat(parts):
            parts = [PackedInt4.concat(parts)]
        self.parts = parts
        self.bias = bias
        self.backend = backend
        self._dense: dict[int, torch.Tensor] = {}  # CPU only: part index -> dequantized [out, in] weight

    def _dense_for_cpu(self, index: int, weight: PackedInt4, dtype: torch.dtype) -> torch.Tensor:
        """The CPU has no int4 matmul kernel: dequantizing every step made a 135M model decode at ~1 tok/s.
        On the torch reference path we dequantize each packed weight once (bit-exact, kernels/reference.py)
        and keep it dense; GPU paths keep weights packed and run the W4A16 kernel."""
        if index not in self._dense:
            from kernels.reference import dequantize_int4

            dense = dequantize_int4(weight.qweight, weight.scales.to(dtype), weight.zeros.to(dtype),
                                    weight.group_size)  # [in, out] in kernel row order
            if weight.perm is not None:  # y = x[:, perm] @ W  ==  x @ W' with W'[perm[k]] = W[k]
                dense = torch.zeros_like(dense).index_copy_(0, weight.perm.long(), dense)
            self._dense[index] = dense.t().contiguous()  # [out, in] for F.linear
        return self._dense[index]

    @property
    def out_features(self) -> int:
        return sum(p.shape[0] if isinstance(p, torch.Tensor) else p.out_features for p in self.parts)

    def nbytes(self) -> int:
        total = sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes() for p in self.parts)
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def _apply(self, index: int, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return torch.nn.functional.linear(x, weight)
        if not self.backend.use_triton and x.device.type == "cpu":
            return torch.nn.functional.linear(x, self._dense_for_cpu(index, weight, x.dtype))
        return self.backend.w4a16_matmul(x, weight.qweight, weight.scales, weight.zeros, weight.group_size,
                                         weight.perm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        outs = [self._apply(i, x, w) for i, w in enumerate(self.parts)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias
