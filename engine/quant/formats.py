"""Which 4-bit format a checkpoint uses: read ``quantization_config`` and pick the loader, or refuse clearly.

Hub checkpoints describe their quantization in ``config.json`` (``quantization_config``, written by
transformers, AutoAWQ, AutoGPTQ and GPTQModel) or, for older AutoGPTQ/AutoAWQ exports, in a separate
``quantize_config.json`` / ``quant_config.json``. Field names drifted between tools (``bits``/``w_bit``,
``group_size``/``q_group_size``, ``checkpoint_format``/``format``), so they are normalised here once.
Everything we cannot load bit-exactly is refused with an ``EngineError`` naming the field and its value.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config import read_folder_quantization_config
from engine.errors import EngineError
from engine.layers.linear import PackedInt4

GetTensor = Callable[[str], "torch.Tensor | None"]

_DECODER_LAYER = re.compile(r"(^|\.)(layers|h|blocks)\.\d+\.")
_DENSE_SUFFIXES = ("lm_head", "embed_tokens", "wte", "norm")


class QuantMethod(ABC):
    """A checkpoint's quantization: which linear layers are packed, and how to turn their tensors into ours."""

    name: str = ""

    def __init__(self, bits: int, group_size: int, modules_to_not_convert: list[str] | None = None):
        self.bits = bits
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    def is_quantized(self, prefix: str) -> bool:
        """True for linear layers inside decoder blocks, unless excluded; lm_head and embeddings stay dense.

        ``prefix`` is the module path without ``.weight``, e.g. ``model.layers.0.self_attn.q_proj``.
        """
        if not _DECODER_LAYER.search(prefix):
            return False
        if prefix.rsplit(".", 1)[-1].endswith(_DENSE_SUFFIXES):
            return False
        return not any(name and name in prefix for name in self.modules_to_not_convert)

    @abstractmethod
    def load_linear(self, get_tensor: GetTensor, prefix: str, in_features: int, out_features: int,
                    dtype: torch.dtype) -> PackedInt4:
        """Read ``prefix.qweight`` etc. through ``get_tensor`` (None for a missing name) and repack them."""

    def effective_group(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def config_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` this method writes (and reads back)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bits={self.bits}, group_size={self.group_size})"


def get_quant_method(model_dir: Path, config: dict) -> QuantMethod | None:
    """The loader for a checkpoint's quantization, or None when it is not quantized.

    Raises EngineError naming the field (``quant_method``, ``bits``, ``version``, ``checkpoint_format``...)
    when the checkpoint uses a variant Pagoda does not load.
    """
    from engine.quant.awq import AWQMethod
    from engine.quant.gptq import GPTQMethod

    qcfg = read_folder_quantization_config(model_dir, config)
    if qcfg is None:
        return None
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "awq":
        return AWQMethod.from_config(qcfg)
    if method == "gptq":
        return GPTQMethod.from_config(qcfg)
    raise EngineError(f"unsupported quantization_config.quant_method {qcfg.get('quant_method')!r}: "
                      f"Pagoda loads 'awq' (GEMM) and 'gptq' 4-bit checkpoints", param="quant_method")


def config_value(qcfg: dict, *names: str, default: Any = None) -> Any:
    """The first of several spellings of a field that is present (tools disagree on names)."""
    for name in names:
        if name in qcfg and qcfg[name] is not None:
            return qcfg[name]
    return default


def require_bits(qcfg: dict, allowed: tuple[int, ...] = (4,)) -> int:
    bits = config_value(qcfg, "bits", "w_bit", default=4)
    if bits not in allowed:
        raise EngineError(f"unsupported quantization_config.bits {bits!r}: only {'/'.join(map(str, allowed))}-bit "
                          f"{qcfg.get('quant_method')} checkpoints load", param="bits")
    return int(bits)


def require_group_size(qcfg: dict) -> int:
    group_size = int(config_value(qcfg, "group_size", "q_group_size", default=128))
    if group_size != -1 and group_size <= 0:
        raise EngineError(f"unsupported quantization_config.group_size {group_size}", param="group_size")
    return group_size


def fetch(get_tensor: GetTensor, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
          method: str) -> torch.Tensor:
    """One checkpoint tensor, checked for presence, shape and dtype, with messages that name it."""
    tensor = get_tensor(name)
    if tensor is None:
        raise EngineError(f"{method} checkpoint is missing tensor '{name}' (expected shape {list(shape)})",
                          param=name)
    if tuple(tensor.shape) != tuple(shape):
        raise EngineError(f"{method} checkpoint tensor '{name}' has shape {list(tensor.shape)}, expected "
                          f"{list(shape)}: the checkpoint does not match its config", param=name)
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise EngineError(f"{method} checkpoint tensor '{name}' has dtype {str(tensor.dtype).replace('torch.', '')}, "
                          f"expected {allowed}", param=name)
    return tensor


def check_divisible(value: int, by: int, what: str, prefix: str, method: str) -> None:
    if value % by != 0:
        raise EngineError(f"{method} layer '{prefix}': {what} {value} is not a multiple of {by}", param=prefix)


SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SHIFTS = tuple(range(0, 32, 4))


def pack_nibbles(nibbles: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack size-8 ``dim`` of int codes 0..15 into int32, element ``i`` in bits 4i..4i+3 (wrapping into the sign bit).

    Plain int32 shifts and ors: an int64 round trip would need 2x the memory of the codes on a 7B model.
    """
    nibbles = nibbles.to(torch.int32)
    packed = nibbles.select(dim, 0).clone(memory_format=torch.contiguous_format)
    for i in range(1, 8):
        packed |= nibbles.select(dim, i) << _SHIFTS[i]
    return packed


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: a new size-8 axis at ``dim`` holding codes 0..15 (int32)."""
    return torch.stack([(packed >> shift) & 0xF for shift in _SHIFTS], dim=dim)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] codes -> [K // 8, N] int32, nibble j of row r = row 8r + j (GPTQ's qweight; the kernel layout is
    ``kernels.reference.rows_to_blocks`` of it)."""
    k, n = codes.shape
    return pack_nibbles(codes.reshape(k // 8, 8, n), dim=1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_rows``: [K // 8, N] int32 -> [K, N] int32."""
    return unpack_nibbles(packed, dim=1).reshape(-1, packed.shape[1])


def pack_cols(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes -> [R, C // 8] int32, nibble j of column c = column 8c + j (GPTQ's qzeros)."""
    r, c = codes.shape
    return pack_nibbles(codes.reshape(r, c // 8, 8), dim=2)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_cols``: [R, C // 8] int32 -> [R, C] int32."""
    return unpack_nibbles(packed, dim=2).reshape(packed.shape[0], -1)
