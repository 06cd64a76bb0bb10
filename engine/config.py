"""Frozen engine configuration: EngineArgs (user-facing, vLLM names), ModelConfig (from config.json), CacheConfig."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.errors import EngineError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int | float | None) -> int | None:
    """'512MiB' / '20GiB' / '1.5GB' / 123 -> bytes."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise EngineError(f"cannot parse memory amount {value!r} (use e.g. '512MiB' or '20GiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype: str | None) -> torch.dtype:
    """'auto' is the checkpoint's dtype on GPU (fp16 if it is fp32) and float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        chosen = _DTYPES.get(config_dtype or "float16", torch.float16)
        return torch.float16 if chosen == torch.float32 else chosen
    if dtype not in _DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}; choose one of auto, float32, float16, bfloat16", param="dtype")
    return _DTYPES[dtype]


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass(frozen=True)
class EngineArgs:
    """What a user can set, under vLLM's names (``--max-model-len`` etc. on the command line)."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    gpu_memory_limit: str | None = None
    kv_cache_memory: str | None = None  # explicit KV budget (CPU default: 256MiB)
    enforce_eager: bool = False
    force_reference_kernels: bool = False
    fused_decode: bool = True  # one-sequence decode steps through the fused layer where the model allows it

    def with_overrides(self, **kwargs) -> "EngineArgs":
        unknown = set(kwargs) - set(self.__dataclass_fields__)
        if unknown:
            raise EngineError(f"unknown engine argument(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
        return replace(self, **kwargs)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from a HF ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quantization_config: dict | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_dict(cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise EngineError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                              f"Pagoda runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_params = cfg.get("rope_parameters") or {}
            return ModelConfig(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
                rope_scaling=cfg.get("rope_scaling") or _rope_scaling_from_parameters(rope_params),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                eos_token_ids=eos_ids,
                bos_token_id=cfg.get("bos_token_id"),
                quantization_config=cfg.get("quantization_config"),
                raw=cfg,
            )
        except KeyError as exc:
            raise EngineError(f"config.json is missing the field {exc.args[0]!r}") from exc

    @staticmethod
    def from_path(model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise EngineError(f"no config.json in {model_dir}: not a model folder")
        return ModelConfig.from_dict(json.loads(path.read_text()))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.tensor([], dtype=dtype).element_size()


# Older AutoGPTQ / AutoAWQ exports keep the quantization beside config.json instead of inside it.
QUANT_SIDE_FILES = ("quantize_config.json", "quant_config.json")


def read_quantization_config(config: dict, read_side_file: Callable[[str], dict | None]) -> dict | None:
    """The checkpoint's ``quantization_config``: from config.json, else from a side file; None when unquantized.

    The one reader for the loader, the folder check and the Hub download check: ``read_side_file(name)`` returns
    a side file's JSON (None when the checkpoint has no such file), so a local folder and a Hub repo read alike.
    """
    qcfg = config.get("quantization_config")
    if qcfg:
        return dict(qcfg)
    for name in QUANT_SIDE_FILES:
        try:
            side = read_side_file(name)
        except ValueError as exc:
            raise EngineError(f"{name} is not valid JSON: {exc}", param="quantization_config") from exc
        if side is None:
            continue
        side = dict(side)
        if name == "quant_config.json" and "quant_method" not in side:
            side["quant_method"] = "awq"  # early AutoAWQ side file: {"w_bit", "q_group_size", "version"}
        side.setdefault("quant_method", "gptq")  # AutoGPTQ's quantize_config.json predates the field
        return side
    return None


def read_folder_quantization_config(model_dir: str | Path, config: dict) -> dict | None:
    """``read_quantization_config`` for a local model folder."""
    def side_file(name: str) -> dict | None:
        path = Path(model_dir) / name
        return json.loads(path.read_text()) if path.is_file() else None

    return read_quantization_config(config, side_file)


def _rope_scaling_from_parameters(params: dict) -> dict | None:
    """transformers 5 writes ``rope_parameters`` instead of ``rope_scaling``; keep only a non-default type."""
    kind = params.get("rope_type") or params.get("type")
    return dict(params) if kind not in (None, "default") else None
