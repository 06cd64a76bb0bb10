"""AutoAWQ "GEMM" checkpoints: unpack their interleaved nibbles into Pagoda's int4 layout, and pack ours like them.

AutoAWQ's ``WQLinear_GEMM`` stores, per linear layer ``prefix``:

- ``qweight`` int32 ``[in, out / 8]``: eight output columns per int32, nibble ``i`` (bits 4i..4i+3) of
  ``qweight[k, c]`` holding output column ``8c + AWQ_ORDER[i]`` with ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``
  (the order its CUDA kernel dequantizes fastest in);
- ``qzeros`` int32 ``[in / G, out / 8]``: integer zero-points packed the same way;
- ``scales`` float16 ``[in / G, out]``; ``w[k, n] = (code - zero) * scale`` with group ``k // G``.

Pagoda's kernels want the codes packed along the input dimension instead (kernels/reference.py), so the
loader unpacks the columns and repacks the rows; scales and zero-points become activation-dtype tensors.
"""

from __future__ import annotations

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
    pack_nibbles,
    pack_rows,
    require_bits,
    require_group_size,
    unpack_nibbles,
)
from kernels.reference import INT4_BLOCK, rows_to_blocks

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds column 8c + AWQ_ORDER[i]
_AWQ_UNORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j sits in nibble _AWQ_UNORDER[j]
SUPPORTED_VERSION = "gemm"


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 8] int32 in AWQ column order -> [rows, cols] int32 codes 0..15."""
    nibbles = unpack_nibbles(packed, dim=2)  # [rows, cols / 8, 8], by nibble position
    return nibbles[:, :, list(_AWQ_UNORDER)].reshape(packed.shape[0], -1)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] integer codes 0..15 -> [rows, cols / 8] int32 in AWQ column order (inverse of unpack_awq)."""
    rows, cols = codes.shape
    by_column = codes.to(torch.int32).reshape(rows, cols // 8, 8)
    return pack_nibbles(by_column[:, :, list(AWQ_ORDER)], dim=2)  # nibble i <- column AWQ_ORDER[i]


def awq_tensors(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors AutoAWQ's ``WQLinear_GEMM`` saves for one layer.

    codes: [out, in] integer-valued; scales, zeros: [in / G, out] -> qweight, qzeros, scales (fp16).
    """
    return {
        "qweight": pack_awq(codes.t().contiguous()),  # [in, out / 8]
        "qzeros": pack_awq(zeros.round().to(torch.int32)),  # [in / G, out / 8]
        "scales": scales.to(torch.float16).contiguous(),  # [in / G, out]
    }


class AWQMethod(QuantMethod):
    """AutoAWQ GEMM, 4-bit, asymmetric (zero_point true)."""

    name = "awq"

    @classmethod
    def from_config(cls, qcfg: dict) -> AWQMethod:
        version = str(config_value(qcfg, "version", default=SUPPORTED_VERSION)).lower()
        if version != SUPPORTED_VERSION:
            raise EngineError(f"unsupported AWQ quantization_config.version {version!r}: Pagoda loads AutoAWQ "
                              f"'gemm' checkpoints (not gemv, gemv_fast, marlin, exllama or ipex ones)",
                              param="version")
        if config_value(qcfg, "zero_point", default=True) is not True:
            raise EngineError("unsupported AWQ quantization_config.zero_point false: AutoAWQ GEMM checkpoints "
                              "are zero-point (asymmetric) checkpoints", param="zero_point")
        bits = require_bits(qcfg)
        return cls(bits, require_group_size(qcfg), config_value(qcfg, "modules_to_not_convert", default=[]))

    def config_dict(self) -> dict[str, Any]:
        return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": True,
                "version": SUPPORTED_VERSION, "modules_to_not_convert": self.modules_to_not_convert or None}

    def load_linear(self, get_tensor: GetTensor, prefix: str, in_features: int, out_features: int,
                    dtype: torch.dtype) -> PackedInt4:
        group = self.effective_group(in_features)
        check_divisible(out_features, 8, "out_features", prefix, "AWQ")
        check_divisible(in_features, INT4_BLOCK, "in_features (the kernels' packed blocks)", prefix, "AWQ")
        check_divisible(in_features, group, f"in_features (group_size {self.group_size})", prefix, "AWQ")
        num_groups = in_features // group
        qweight = fetch(get_tensor, f"{prefix}.qweight", (in_features, out_features // 8), (torch.int32,), "AWQ")
        qzeros = fetch(get_tensor, f"{prefix}.qzeros", (num_groups, out_features // 8), (torch.int32,), "AWQ")
        scales = fetch(get_tensor, f"{prefix}.scales", (num_groups, out_features), SCALE_DTYPES, "AWQ")
        codes = unpack_awq(qweight)  # [in, out]
        zeros = unpack_awq(qzeros)  # [in / G, out]
        return PackedInt4(rows_to_blocks(pack_rows(codes)), scales.to(dtype), zeros.to(dtype), group)
