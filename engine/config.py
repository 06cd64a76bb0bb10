"""Frozen engine configuration: EngineArgs (user-facing, vLLM names), ModelConfig (from config.json), CacheConfig."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.errors import EngineError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma3ForCausalLM")
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
PHI3 = "Phi3ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' layer_types names
GEMMA3_SLIDING_PATTERN = 6  # Gemma3TextConfig's default sliding_window_pattern: every 6th layer is global
PHI3_ORIGINAL_MAX_POSITIONS = 4096  # Phi3Config's default for original_max_position_embeddings

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | float | None) -> int | None:
    """'512MiB' / '20GiB' / '1.5GB' / 123 -> bytes."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise EngineError(f"cannot parse memory amount {value!r} (use e.g. '512MiB' or '20GiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype: str | None) -> torch.dtype:
    """'auto' is ``config_dtype`` on GPU (fp16 if it is fp32) and float32 on CPU. ``config_dtype`` is
    ``ModelConfig.torch_dtype``: the checkpoint's dtype, bf16 for Gemma 3 (see ``_auto_dtype_source``)."""
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
    max_num_seqs: int = 256  # vLLM's default
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
    # ... its int4 GEMVs reading their rows in 16-bit fixed point where that pays (x16_rows_supported): 7B AWQ
    # batch 1 +2.5%, 8B +1.1% in one H100 run (BENCHMARKS.md, session 22); off: the half2 dot over fp16 rows
    x16_rows: bool = True
    tensor_parallel_size: int = 1  # ranks the model is split over (engine/parallel.py); 1: this process alone
    async_scheduling: bool = True  # schedule a decode step before the previous one's tokens are back (vLLM's name)
    # "int8": the LM head held as int8 rows with a scale each (engine/layers/linear.py Int8Rows), half the bytes a
    # token reads there (8B: 1.05 of 4.70 GB fp16), at a small change of the logits; "none": as the checkpoint has it
    lm_head_quantization: str = "none"

    def with_overrides(self, **kwargs) -> EngineArgs:
        unknown = set(kwargs) - set(self.__dataclass_fields__)
        if unknown:
            raise EngineError(f"unknown engine argument(s): {', '.join(sorted(unknown))}", param=min(unknown))
        return replace(self, **kwargs)


@dataclass(frozen=True)
class ContextLimit:
    """The longest context at which the engine computes what transformers computes for a model, and why."""

    tokens: int
    reason: str


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from a HF ``config.json``.

    ``max_position_embeddings`` is the longest context Pagoda serves the model at by default: the config's value,
    capped by ``context_limit`` where the engine matches transformers only up to a shorter length (LongRoPE's
    original length). ``rope_scaling`` is the config's dict with
    the fields transformers fills in at load (canonical ``rope_type``, ``original_max_position_embeddings``).
    """

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
    attention_bias: bool  # biases on q, k and v
    torch_dtype: str | None  # the dtype 'auto' starts from on a GPU (resolve_dtype): the checkpoint's, but see
    # _auto_dtype_source (Gemma 3 runs in bf16 whatever its checkpoint says)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quantization_config: dict | None = None
    o_proj_bias: bool = False  # Llama's attention_bias also gives o_proj one (Qwen2's does not)
    mlp_bias: bool = False  # Llama's mlp_bias: gate, up and down
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k (weights [head_dim]) before rotary
    fused_projections: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj as one matrix each
    partial_rotary_factor: float = 1.0  # rotary on the first int(head_dim * factor) dims of a head (Phi-4-mini)
    context_limit: ContextLimit | None = None
    layer_windows: tuple[int, ...] = ()  # per layer: the sliding-window length, 0 for full attention (() : none)
    query_pre_attn_scalar: float | None = None  # Gemma 3: attention scores scale by its -1/2 power, not head_dim's
    final_logit_softcapping: float | None = None  # Gemma: logits = tanh(logits / cap) * cap
    local_rope_theta: float | None = None  # Gemma 3: rope base of the sliding-window layers (default rope type)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def window_of(self, layer: int) -> int:
        """Layer ``layer``'s sliding window in tokens (a query sees itself and window - 1 keys before it); 0: all."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax (transformers: ``query_pre_attn_scalar ** -0.5`` for Gemma)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates by the local table (Gemma 3's sliding layers; from_dict refuses a Gemma
        config whose sliding layers have no window, so a window marks them)."""
        return self.local_rope_theta is not None and self.window_of(layer) > 0

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each q/k head that rotary turns (transformers: ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @staticmethod
    def from_dict(cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise EngineError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                              f"Pagoda runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        raw = cfg
        try:
            _check_family(cfg, arch)
            cfg, gemma = _gemma3_config(cfg) if arch == GEMMA3 else (cfg, {})
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_params = cfg.get("rope_parameters") or {}
            scaling = _rope_scaling(cfg, arch, rope_params)
            limit = _context_limit(cfg, arch, scaling)
            max_positions = int(cfg.get("max_position_embeddings", 2048))
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
                rope_scaling=scaling,
                max_position_embeddings=min(max_positions, limit.tokens) if limit else max_positions,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                torch_dtype=_auto_dtype_source(cfg, arch),
                eos_token_ids=eos_ids,
                bos_token_id=cfg.get("bos_token_id"),
                quantization_config=cfg.get("quantization_config"),
                o_proj_bias=arch == "LlamaForCausalLM" and bool(cfg.get("attention_bias")),
                mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias")),
                qk_norm=arch in (QWEN3, GEMMA3),
                fused_projections=arch == PHI3,
                partial_rotary_factor=_partial_rotary_factor(cfg, arch, rope_params),
                context_limit=limit,
                layer_windows=_layer_windows(cfg, arch),
                raw=raw,
                **gemma,
            )
        except KeyError as exc:
            raise EngineError(f"config.json is missing the field {exc.args[0]!r}") from exc

    @staticmethod
    def from_path(model_dir: str | Path) -> ModelConfig:
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


def _check_family(cfg: dict, arch: str) -> None:
    """Refuse what the new families' configs may say that Pagoda does not compute (never run such a model wrong)."""
    if arch == GEMMA3:
        _check_gemma3(cfg)
        return
    if arch not in (QWEN3, PHI3):
        return  # the Llama family keeps its checks as they were
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise EngineError(f"unsupported hidden_act {act!r} for {arch}: Pagoda's MLP is SwiGLU (silu)")
    if arch == QWEN3 and cfg.get("attention_bias"):
        raise EngineError("unsupported Qwen3 config: attention_bias true (biases on q/k/v and o) is not loaded; "
                          "published Qwen3 models have none")


def _check_gemma3(cfg: dict) -> None:
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise EngineError(f"unsupported hidden_activation {act!r} for Gemma 3: Pagoda's Gemma MLP is GeGLU with "
                          "gelu_pytorch_tanh")
    if cfg.get("attn_logit_softcapping") is not None:
        raise EngineError(f"unsupported Gemma config: attn_logit_softcapping {cfg['attn_logit_softcapping']} "
                          "(tanh soft-capping of the attention scores) is not in Pagoda's attention kernels; "
                          "published Gemma 3 models set it to null")
    if cfg.get("use_bidirectional_attention"):
        raise EngineError("unsupported Gemma config: use_bidirectional_attention (an embedding model's "
                          "non-causal attention) is not a generative model Pagoda serves")
    if cfg.get("attention_bias"):
        raise EngineError("unsupported Gemma config: attention_bias true (biases on q/k/v and o) is not loaded; "
                          "published Gemma 3 models have none")


def _gemma3_rope(cfg: dict) -> tuple[dict, dict]:
    """(full-attention, sliding-attention) rope dicts as Gemma3TextConfig resolves them.

    transformers 5 writes ``rope_parameters`` per layer type; older configs write ``rope_theta`` and
    ``rope_scaling`` for the global layers and ``rope_local_base_freq`` for the sliding ones.
    """
    params = cfg.get("rope_parameters")
    if params and not all(isinstance(params.get(kind), (dict, type(None))) for kind in LAYER_TYPES):
        raise EngineError("Gemma 3's rope_parameters must be given per layer type "
                          "(full_attention, sliding_attention)")
    params = params or {}
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    full.update(cfg.get("rope_scaling") or {})
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    local_kind = sliding.get("rope_type") or sliding.get("type") or "default"
    if local_kind != "default":
        raise EngineError(f"unsupported Gemma 3 rope on the sliding layers: type {local_kind!r} (Pagoda runs the "
                          "default rope there, as published Gemma 3 models do)")
    return full, sliding


def _gemma3_layer_types(cfg: dict) -> list[str]:
    """``layer_types``, or Gemma3TextConfig's default: every ``sliding_window_pattern``-th layer global."""
    num_layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or GEMMA3_SLIDING_PATTERN)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(num_layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise EngineError(f"unsupported Gemma 3 layer type(s) {', '.join(unknown)}: Pagoda runs "
                          f"{' and '.join(LAYER_TYPES)} layers")
    if "sliding_attention" in types and not cfg.get("sliding_window"):
        raise EngineError("Gemma 3 config marks sliding_attention layers but sets no sliding_window")
    return list(types)


def _gemma3_config(cfg: dict) -> tuple[dict, dict]:
    """Gemma 3's config.json in the form the Llama reader takes, and Gemma's own ModelConfig fields.

    The global layers' rope becomes ``rope_theta`` / ``rope_scaling``, the sliding layers' base
    ``local_rope_theta``; Gemma3TextConfig's defaults (tied head, head_dim 256, query_pre_attn_scalar 256)
    fill what the file leaves out.
    """
    full, sliding = _gemma3_rope(cfg)
    kind = full.get("rope_type") or full.get("type") or "default"
    llama_form = {**cfg, "rope_theta": float(full["rope_theta"]), "rope_scaling": None if kind == "default" else full,
                  "rope_parameters": None, "layer_types": _gemma3_layer_types(cfg),
                  "tie_word_embeddings": cfg.get("tie_word_embeddings", True), "head_dim": cfg.get("head_dim") or 256}
    cap = cfg.get("final_logit_softcapping")
    fields = {"query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
              "final_logit_softcapping": None if cap is None else float(cap),
              "local_rope_theta": float(sliding["rope_theta"])}
    return llama_form, fields


def _auto_dtype_source(cfg: dict, arch: str) -> str | None:
    """The dtype 'auto' starts from: the checkpoint's, except for Gemma 3, whose activations overflow fp16 (its
    residual stream grows past 65504), so it runs in bf16 whatever the checkpoint (or a 4-bit build) says."""
    return "bfloat16" if arch == GEMMA3 else (cfg.get("torch_dtype") or cfg.get("dtype"))


def _rope_scaling(cfg: dict, arch: str, rope_params: dict) -> dict | None:
    """The config's rope scaling with the fields transformers resolves at load for the types that need them.

    Phi3Config renames ``su`` and ``yarn`` to ``longrope``. ``original_max_position_embeddings``: for Phi-3
    transformers puts the top-level field (default 4096) over the rope dict's, except under the old name ``su``;
    elsewhere the rope dict's, else ``max_position_embeddings``. A longrope ``factor`` defaults to
    max / original positions (it sets the attention factor). llama3 without the field uses
    ``max_position_embeddings`` as transformers does. Default and linear dicts pass unchanged.
    """
    scaling = cfg.get("rope_scaling") or _rope_scaling_from_parameters(rope_params)
    if not scaling:
        return None
    named = scaling.get("rope_type") or scaling.get("type")
    kind = "longrope" if arch == PHI3 and named in ("su", "yarn") else named
    if kind == "llama3" and not scaling.get("original_max_position_embeddings"):
        return dict(scaling, original_max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)))
    if kind not in ("longrope", "yarn", "dynamic"):
        return scaling
    resolved = dict(scaling, rope_type=kind)
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    if kind == "dynamic":
        return resolved
    if arch == PHI3 and named != "su":
        original = cfg.get("original_max_position_embeddings") or PHI3_ORIGINAL_MAX_POSITIONS
    else:
        original = scaling.get("original_max_position_embeddings") or (None if named == "su" else max_positions)
    if original is None:
        raise EngineError("rope_scaling type 'su' needs original_max_position_embeddings in rope_scaling")
    resolved["original_max_position_embeddings"] = int(original)
    if kind == "longrope" and resolved.get("factor") is None:
        resolved["factor"] = max_positions / int(original)
    return resolved


def _partial_rotary_factor(cfg: dict, arch: str, rope_params: dict) -> float:
    """transformers reads it from the rope dict first, then the top level; only Phi-3 slices q/k for it."""
    scaling = cfg.get("rope_scaling") or {}
    factor = next((float(d["partial_rotary_factor"]) for d in (scaling, rope_params, cfg)
                   if d.get("partial_rotary_factor") is not None), 1.0)
    if factor != 1.0 and arch != PHI3:
        raise EngineError(f"unsupported partial_rotary_factor {factor} for {arch}: only Phi-3 rotates part of a head")
    if not 0.0 < factor <= 1.0:
        raise EngineError(f"unsupported partial_rotary_factor {factor}: it must be in (0, 1]")
    return factor


def _layer_windows(cfg: dict, arch: str) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it (() when no layer has one).

    Mistral and Phi-3 window every layer when ``sliding_window`` is set (Llama's attention has no window);
    Qwen2 and Qwen3 only with ``use_sliding_window`` (their configs carry a ``sliding_window`` value that is off
    by default), on the layers ``layer_types`` marks ``sliding_attention``, by default those from
    ``max_window_layers`` on. Gemma 3 on its ``sliding_attention`` layers (``_gemma3_config`` fills
    ``layer_types`` in).
    """
    window = cfg.get("sliding_window")
    num_layers = int(cfg.get("num_hidden_layers", 0))
    if not window or arch == "LlamaForCausalLM":
        return ()
    types = cfg.get("layer_types")
    if arch in (QWEN2, QWEN3):
        if not cfg.get("use_sliding_window"):
            return ()
        first_windowed = int(cfg.get("max_window_layers", 28))
        types = types or ["sliding_attention" if i >= first_windowed else "full_attention" for i in range(num_layers)]
    if types is None:
        return (int(window),) * num_layers
    if len(types) != num_layers:
        raise EngineError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    windows = tuple(int(window) if kind == "sliding_attention" else 0 for kind in types)
    return windows if any(windows) else ()


def _context_limit(cfg: dict, arch: str, scaling: dict | None) -> ContextLimit | None:
    """The shortest length past which transformers computes something Pagoda does not (None: no such length).

    LongRoPE: transformers uses the long factors for a whole forward once it reaches past
    original_max_position_embeddings, so a long prompt's early keys are rotated otherwise than a short prompt's
    that decoded past that length: no position-indexed table gives both. Dynamic NTK: the base grows with the
    sequence past max_position_embeddings, again per forward.
    """
    limits = []
    kind = (scaling or {}).get("rope_type")
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        limits.append(ContextLimit(original, f"LongRoPE switches to its long factors past "
                                             f"original_max_position_embeddings ({original}) per forward pass, "
                                             "which a position-indexed rotary table cannot reproduce"))
    if kind == "dynamic":
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        limits.append(ContextLimit(max_positions, f"dynamic NTK rope rescales its base per forward pass past "
                                                  f"max_position_embeddings ({max_positions})"))
    return min(limits, key=lambda limit: limit.tokens) if limits else None


def check_context_limit(config: ModelConfig, max_model_len: int) -> None:
    """Refuse a context the engine would compute differently from transformers (see ``_context_limit``)."""
    limit = config.context_limit
    if limit is not None and max_model_len > limit.tokens:
        raise EngineError(f"max_model_len {max_model_len} is longer than Pagoda runs this model exactly: "
                          f"{limit.reason}; use --max-model-len {limit.tokens} or less", param="max_model_len")
