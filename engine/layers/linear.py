"""Linear layers whose weights are dense or packed int4 (W4A16), with a merged form for qkv and gate/up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.errors import EngineError
from kernels.ops import Backend
from kernels.reference import INT4_BLOCK

if TYPE_CHECKING:
    from engine.parallel import TPGroup


@dataclass
class PackedInt4:
    """A 4-bit weight in the kernel layout of kernels/reference.py (one layout for AWQ and GPTQ).

    qweight: [K // 8, N] int32 (K a multiple of ``INT4_BLOCK``); scales, zeros: [K // group_size, N] activation dtype;
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

    def to(self, device: torch.device | str, dtype: torch.dtype) -> PackedInt4:
        perm = None if self.perm is None else self.perm.to(device)
        return PackedInt4(self.qweight.to(device), self.scales.to(device, dtype), self.zeros.to(device, dtype),
                          self.group_size, perm)

    def nbytes(self) -> int:
        parts = [self.qweight, self.scales, self.zeros] + ([self.perm] if self.perm is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def columns(self, start: int, end: int) -> PackedInt4:
        """Output features [start, end) (a column-parallel shard): every tensor is [.., N], so a plain slice."""
        return PackedInt4(self.qweight[:, start:end].contiguous(), self.scales[:, start:end].contiguous(),
                          self.zeros[:, start:end].contiguous(), self.group_size, self.perm)

    def rows(self, start: int, end: int, name: str) -> PackedInt4:
        """Input features [start, end) (a row-parallel shard). The slice must fall on whole groups and packed
        words; one group over all of K (group size -1) gives every shard the same scales. Refuses act-order:
        its permutation mixes rows of every shard into each group."""
        if self.perm is not None:
            raise EngineError(f"{name}: GPTQ act-order (desc_act) weights cannot be split across ranks; use "
                              "--tensor-parallel-size 1 or a build without act-order", param="tensor_parallel_size")
        if start % INT4_BLOCK or end % INT4_BLOCK:
            raise EngineError(f"{name}: a shard of {end - start} of its {self.in_features} input features is not a "
                              f"whole number of packed {INT4_BLOCK}-row blocks; choose a --tensor-parallel-size that "
                              f"makes {self.in_features} / size a multiple of {INT4_BLOCK}", param="tensor_parallel_size")
        if self.scales.shape[0] == 1:  # one group over all of K
            return PackedInt4(self.qweight[start // 8:end // 8].contiguous(), self.scales, self.zeros, end - start)
        group = self.group_size
        if start % group or end % group:
            raise EngineError(f"{name}: a shard of {end - start} of its {self.in_features} input features does not "
                              f"fall on its quantization groups of {group}; choose a --tensor-parallel-size that "
                              f"makes {self.in_features} / size a multiple of {group}", param="tensor_parallel_size")
        return PackedInt4(self.qweight[start // 8:end // 8].contiguous(),
                          self.scales[start // group:end // group].contiguous(),
                          self.zeros[start // group:end // group].contiguous(), group)

    @staticmethod
    def can_concat(parts: list[PackedInt4]) -> bool:
        first = parts[0]
        return all(p.group_size == first.group_size and p.in_features == first.in_features
                   and _same_perm(p.perm, first.perm) for p in parts)

    @staticmethod
    def concat(parts: list[PackedInt4]) -> PackedInt4:
        """Stack along the output dimension (q, k, v -> qkv). Caller checks ``can_concat`` first."""
        return PackedInt4(torch.cat([p.qweight for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1),
                          torch.cat([p.zeros for p in parts], dim=1), parts[0].group_size, parts[0].perm)


@dataclass
class Int8Rows:
    """An int8 weight with one scale per output row: W = qweight * scales[:, None] (the optional int8 LM head,
    ``EngineArgs.lm_head_quantization``; llama.cpp's Q4 files keep theirs at Q6_K, the checkpoint's is fp16).

    qweight: [N, K] int8 in the Linear's own [out, in] layout, codes in -127..127; scales: [N] activation dtype.
    """

    qweight: torch.Tensor
    scales: torch.Tensor

    CHUNK_ROWS = 8192  # rows quantized at a time: the float32 copy of an 8B head's 128,256 rows would be 2.1 GB

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int8Rows:
        """Symmetric round-to-nearest per row, scale = max |w| / 127 rounded to the weight's dtype (the kernels
        multiply by the stored scale). ``weight`` [N, K] may be the tied embedding: it is read, not changed."""
        qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scales = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)
        for start in range(0, weight.shape[0], Int8Rows.CHUNK_ROWS):
            rows = weight[start:start + Int8Rows.CHUNK_ROWS].float()  # [chunk, K]
            scale = (rows.abs().amax(dim=1) / 127).to(weight.dtype)
            scales[start:start + rows.shape[0]] = scale
            safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
            qweight[start:start + rows.shape[0]] = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return Int8Rows(qweight, scales)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))

    def dequantize(self) -> torch.Tensor:
        """[N, K] in the scales' dtype."""
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


Weight = torch.Tensor | PackedInt4


def column_shard(weight: Weight, start: int, end: int) -> Weight:
    """Output features [start, end) of a weight (dense [out, in] or packed)."""
    if isinstance(weight, PackedInt4):
        return weight.columns(start, end)
    return weight[start:end].contiguous()


def row_shard(weight: Weight, start: int, end: int, name: str) -> Weight:
    """Input features [start, end) of a weight (dense [out, in] or packed); refuses what cannot split."""
    if isinstance(weight, PackedInt4):
        return weight.rows(start, end, name)
    return weight[:, start:end].contiguous()


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


class RowParallelLinear:
    """A row-parallel layer (o_proj, down_proj under tensor parallelism): each rank holds the input features of
    its shard, so its output is a partial sum; the all-reduce completes it on every rank and the bias is added
    once, after the sum."""

    def __init__(self, local: Linear, bias: torch.Tensor | None, group: TPGroup):
        self.local, self.bias, self.group = local, bias, group

    @property
    def parts(self) -> list[Weight]:
        return self.local.parts

    @property
    def out_features(self) -> int:
        return self.local.out_features

    def nbytes(self) -> int:
        return self.local.nbytes() + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features / world] -> [num_tokens, out_features]
        y = self.group.all_reduce(self.local(x))
        return y if self.bias is None else y + self.bias


def head_logits(backend: Backend, hidden: torch.Tensor, head: torch.Tensor | Int8Rows | Linear) -> torch.Tensor:
    """hidden [rows, K] @ head^T -> [rows, N] in hidden's dtype: the LM head dense, as int8 rows, or packed int4
    (a ``Linear``: a GPTQ checkpoint with ``lm_head: true``)."""
    if isinstance(head, Int8Rows):
        return backend.w8a16_matmul(hidden, head.qweight, head.scales)
    if isinstance(head, Linear):
        return head(hidden)
    return torch.nn.functional.linear(hidden, head)
