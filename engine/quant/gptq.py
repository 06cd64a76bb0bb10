"""GPTQ checkpoints (AutoGPTQ / GPTQModel, v1 and v2 zero-points, act-order ``g_idx``) into Pagoda's int4 layout.

Per linear layer ``prefix``:

- ``qweight`` int32 ``[in / 8, out]``: nibble ``j`` of ``qweight[r, n]`` is the code of input row ``8r + j``
  (the loader transposes the nibbles of each 8-word block into the kernels' layout, ``rows_to_blocks``);
- ``qzeros`` int32 ``[n_groups, out / 8]``: zero-points packed along the output dimension, nibble ``j`` of
  ``qzeros[g, c]`` for column ``8c + j``. ``checkpoint_format`` "gptq" (v1, AutoGPTQ) stores ``zero - 1``
  (packed as the int32 value ``v2 - 0x11111111``, which is exactly nibble-wise ``zero - 1`` whenever every
  zero is >= 1, and is how GPTQModel converts between the two); "gptq_v2" stores the zero itself;
- ``scales`` ``[n_groups, out]``; ``g_idx`` int32 ``[in]``: the group of every input row. Without act-order
  it is ``k // G``; with act-order (``desc_act``) it is a permuted version of that, and the loader sorts the
  rows by group (``perm = argsort(g_idx, stable)``) so that groups are contiguous, which is the layout
  ``PackedInt4.perm`` describes (``y = x[:, perm] @ W``).

``n_groups`` is ``ceil(in / G)`` as in AutoGPTQ (``G = in`` for group size -1); a last partial group is
re-expressed with smaller whole groups, so ``PackedInt4`` always has ``in % group_size == 0``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from engine.errors import EngineError
from engine.layers.linear import PackedInt4
from engine.quant.formats import (
    SCALE_DTYPES,
    GetTensor,
    QuantMethod,
    check_divisible,
    config_value,
    fetch,
    pack_cols,
    pack_rows,
    require_bits,
    require_group_size,
    unpack_cols,
    unpack_rows,
)
from kernels.reference import INT4_BLOCK, rows_to_blocks

FORMATS = ("gptq", "gptq_v2")
V1_OFFSET = 0x11111111  # one added to each of the eight 4-bit zero-points of an int32


def v1_to_v2(qzeros: torch.Tensor) -> torch.Tensor:
    """Stored v1 zero-points (``zero - 1``) -> v2 (``zero``), as an int32 add of one per nibble (GPTQModel)."""
    return _to_int32((qzeros.to(torch.int64) + V1_OFFSET) & 0xFFFFFFFF)


def v2_to_v1(qzeros: torch.Tensor) -> torch.Tensor:
    return _to_int32((qzeros.to(torch.int64) - V1_OFFSET) & 0xFFFFFFFF)


def _to_int32(values: torch.Tensor) -> torch.Tensor:
    values = values & 0xFFFFFFFF
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def gptq_tensors(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                 checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The tensors AutoGPTQ / GPTQModel save for one layer.

    codes: [out, in] integer-valued (original input order); scales, zeros: [n_groups, out]; g_idx: [in].
    """
    qzeros = pack_cols(zeros.round().to(torch.int32))  # [n_groups, out / 8]
    if checkpoint_format == "gptq":
        qzeros = v2_to_v1(qzeros)
    return {
        "qweight": pack_rows(codes.t()),  # [in / 8, out]
        "qzeros": qzeros,
        "scales": scales.to(torch.float16).contiguous(),  # [n_groups, out]
        "g_idx": g_idx.to(torch.int32).clone(),  # [in]; a fresh tensor per layer (q/k/v share one)
    }


class GPTQMethod(QuantMethod):
    """AutoGPTQ / GPTQModel 4-bit checkpoints, v1 or v2 zero-points, with or without act-order."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, checkpoint_format: str = "gptq", desc_act: bool = False,
                 sym: bool = True, skip_patterns: list[str] | None = None, group_overrides=None,
                 extra: dict | None = None, quantized_head: bool = False):
        super().__init__(bits, group_size)
        self.quantized_head = quantized_head  # GPTQModel's lm_head=True: the head is packed too (vLLM loads it)
        self.checkpoint_format = checkpoint_format
        self.desc_act = desc_act
        self.sym = sym
        self.skip_patterns = list(skip_patterns or [])
        self.group_overrides: list[tuple[str, int]] = list(group_overrides or [])
        self.extra = dict(extra or {})

    @classmethod
    def from_config(cls, qcfg: dict) -> GPTQMethod:
        bits = require_bits(qcfg)
        fmt = str(config_value(qcfg, "checkpoint_format", "format", default="gptq")).lower()
        if fmt not in FORMATS:
            raise EngineError(f"unsupported GPTQ quantization_config.checkpoint_format {fmt!r}: Pagoda loads "
                              f"'gptq' (v1) and 'gptq_v2' (not marlin, bitblas or exllama v2 ones)",
                              param="checkpoint_format")
        if config_value(qcfg, "is_marlin_format", default=False):
            raise EngineError("unsupported GPTQ quantization_config.is_marlin_format true: Marlin-serialized "
                              "weights are not loaded; use the plain GPTQ checkpoint", param="is_marlin_format")
        pack_dtype = str(config_value(qcfg, "pack_dtype", default="int32")).replace("torch.", "")
        if pack_dtype != "int32":
            raise EngineError(f"unsupported GPTQ quantization_config.pack_dtype {pack_dtype!r}: only int32",
                              param="pack_dtype")
        group_size = require_group_size(qcfg)
        skip, overrides = _parse_dynamic(config_value(qcfg, "dynamic", default={}) or {}, bits)
        extra = {k: qcfg[k] for k in ("true_sequential", "damp_percent", "static_groups") if k in qcfg}
        return cls(bits, group_size, fmt, bool(config_value(qcfg, "desc_act", default=False)),
                   bool(config_value(qcfg, "sym", default=True)), skip, overrides, extra,
                   bool(config_value(qcfg, "lm_head", default=False)))

    def config_dict(self) -> dict[str, Any]:
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.desc_act, "sym": self.sym, "checkpoint_format": self.checkpoint_format,
                **({"lm_head": True} if self.quantized_head else {}), **self.extra}

    def is_quantized(self, prefix: str) -> bool:
        if prefix == "lm_head":
            return self.quantized_head
        if any(re.match(pattern, prefix) for pattern in self.skip_patterns):
            return False
        return super().is_quantized(prefix)

    def group_for(self, prefix: str, in_features: int) -> int:
        group = next((g for pattern, g in self.group_overrides if re.match(pattern, prefix)), self.group_size)
        return in_features if group == -1 else group

    def load_linear(self, get_tensor: GetTensor, prefix: str, in_features: int, out_features: int,
                    dtype: torch.dtype) -> PackedInt4:
        group = self.group_for(prefix, in_features)
        check_divisible(in_features, INT4_BLOCK, "in_features (the kernels' packed blocks)", prefix, "GPTQ")
        check_divisible(out_features, 8, "out_features", prefix, "GPTQ")
        num_groups = math.ceil(in_features / group)
        qweight = fetch(get_tensor, f"{prefix}.qweight", (in_features // 8, out_features), (torch.int32,), "GPTQ")
        qzeros = fetch(get_tensor, f"{prefix}.qzeros", (num_groups, out_features // 8), (torch.int32,), "GPTQ")
        scales = fetch(get_tensor, f"{prefix}.scales", (num_groups, out_features), SCALE_DTYPES, "GPTQ")
        if self.checkpoint_format == "gptq":
            qzeros = v1_to_v2(qzeros)
        zeros = unpack_cols(qzeros)  # [n_groups, out]
        perm = self._act_order_perm(get_tensor, prefix, in_features, group)
        if perm is not None:
            qweight = pack_rows(unpack_rows(qweight)[perm])  # rows sorted by group
        qweight = rows_to_blocks(qweight)
        scales, zeros, group = _whole_groups(scales, zeros, group, in_features)
        return PackedInt4(qweight, scales.to(dtype), zeros.to(dtype), group, perm)

    def _act_order_perm(self, get_tensor: GetTensor, prefix: str, in_features: int,
                        group: int) -> torch.Tensor | None:
        """None when g_idx is absent or trivial (``k // G``); else the row order that makes groups contiguous."""
        name = f"{prefix}.g_idx"
        if get_tensor(name) is None:
            if self.desc_act:
                fetch(get_tensor, name, (in_features,), (torch.int32,), "GPTQ")  # raises: act-order needs g_idx
            return None
        g_idx = fetch(get_tensor, name, (in_features,), (torch.int32, torch.int64), "GPTQ").long()
        trivial = torch.arange(in_features, device=g_idx.device) // group
        if torch.equal(g_idx, trivial):
            return None
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], trivial):
            raise EngineError(f"GPTQ checkpoint tensor '{name}' does not put exactly {group} input rows in each "
                              f"group; such act-order layouts are not supported", param=name)
        return perm


def _whole_groups(scales: torch.Tensor, zeros: torch.Tensor, group: int,
                  in_features: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Re-express a last partial group (``in % G != 0``, which AutoGPTQ allows) with whole groups.

    With ``G' = gcd(in, G)`` every original group is ``G / G'`` consecutive smaller groups with the same
    scale and zero-point, and the partial one is a whole number of them: exact, and the kernels only ever
    see ``in % G' == 0``.
    """
    if in_features % group == 0:
        return scales, zeros, group
    fine = math.gcd(in_features, group)
    repeat = group // fine
    keep = in_features // fine
    return scales.repeat_interleave(repeat, dim=0)[:keep], zeros.repeat_interleave(repeat, dim=0)[:keep], fine


def _parse_dynamic(dynamic: dict, bits: int) -> tuple[list[str], list[tuple[str, int]]]:
    """GPTQModel's per-module ``dynamic`` rules: ``-:regex`` skips modules; ``+:regex`` may change group_size."""
    skip: list[str] = []
    overrides: list[tuple[str, int]] = []
    for key, override in dynamic.items():
        if key.startswith("-:"):
            skip.append(key[2:])
            continue
        pattern = key.removeprefix("+:")
        override = override or {}
        if override.get("bits", bits) != bits:
            raise EngineError(f"unsupported GPTQ quantization_config.dynamic rule {key!r}: bits "
                              f"{override.get('bits')} (only {bits}-bit layers load)", param="dynamic")
        if "group_size" in override:
            overrides.append((pattern, int(override["group_size"])))
    return skip, overrides
