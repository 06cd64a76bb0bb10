"""Will this model fit? Weight, KV and activation bytes from config.json alone, before any weight is downloaded.

Why from the config: users pick models in the UI and on the Hub before fetching gigabytes, and a load that
runs out of memory halfway is the most common local-serving complaint. The numbers follow what the engine
allocates, not what the checkpoint file weighs:

- weights: embeddings, lm_head (unless tied), per layer q/k/v/o + gate/up/down + two RMSNorms, final norm.
  Quantized linears (AWQ/GPTQ) are held as the kernel contract's ``PackedInt4`` (kernels/reference.py):
  ``K * N * bits / 8`` packed bytes + ``scales`` and ``zeros`` ``[K // G, N]`` in the activation dtype
  + an int64 act-order permutation of ``K`` rows when ``desc_act``, one per merged input (q/k/v share one,
  gate/up share one, as the loader concatenates them). Embeddings, lm_head, norms and biases stay in the
  activation dtype, but for ``--lm-head-quantization int8``, where the head is int8 rows with a scale each (a
  tied embedding is kept too, for the lookups), and for a GPTQ checkpoint with ``lm_head: true``, whose head is
  packed like its layers.
- KV cache: ``2 * layers * kv_heads * head_dim * element size`` bytes per token, allocated in whole blocks
  of ``block_size`` tokens: ``num_blocks = kv_budget // bytes_per_block`` (rounded down, as the engine does).
- activations: what the engine's profile of one forward at the token budget will measure (see
  ``estimate_activation_bytes``); pass the profiled peak as ``activation_reserve_bytes`` when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import GEMMA3, EngineArgs, ModelConfig, parse_bytes, resolve_dtype
from engine.errors import EngineError

GiB = 1 << 30
MiB = 1 << 20
CPU_DEFAULT_KV_MEMORY = "256MiB"  # the KV cache on CPU when --kv-cache-memory is not given


def cuda_budget_bytes(args: EngineArgs, device: torch.device) -> int:
    """The device budget, the one rule the KV sizing, the pre-load fit check and the UI's fit column share:
    --gpu-memory-limit (capped at the card) or --gpu-memory-utilization of the card."""
    total = torch.cuda.get_device_properties(device).total_memory
    limit = parse_bytes(args.gpu_memory_limit) if args.gpu_memory_limit else None
    return min(limit, total) if limit else int(total * args.gpu_memory_utilization)


def cpu_kv_cache_bytes(args: EngineArgs) -> int:
    """The fixed KV-cache size on CPU (--kv-cache-memory, else CPU_DEFAULT_KV_MEMORY)."""
    return parse_bytes(args.kv_cache_memory or CPU_DEFAULT_KV_MEMORY)
CUBLAS_WORKSPACE_BYTES = 32 * MiB


@dataclass(frozen=True)
class QuantSpec:
    """The facts of a ``quantization_config`` that decide memory and support."""

    method: str  # "awq" | "gptq" | anything else (unsupported, kept for the message)
    bits: int
    group_size: int  # -1: one group spanning all input rows
    desc_act: bool
    fmt: str | None  # AWQ "version" (gemm/gemv...) or GPTQ "checkpoint_format" (gptq/gptq_v2/marlin...)
    quantized_head: bool = False  # GPTQModel's lm_head: true (the head packed as the layers are)

    @staticmethod
    def from_config(qc: dict | None) -> QuantSpec | None:
        """Read HF transformers / AutoAWQ / AutoGPTQ spellings; None for an unquantized checkpoint."""
        if not qc:
            return None
        method = str(qc.get("quant_method") or ("awq" if "w_bit" in qc else "gptq")).lower()
        bits = int(qc.get("bits") or qc.get("w_bit") or 0)
        group = int(qc.get("group_size") or qc.get("q_group_size") or -1)
        if method == "awq":
            fmt = str(qc.get("version") or "gemm").lower()
        else:
            fmt = qc.get("checkpoint_format") or qc.get("format")
            fmt = str(fmt).lower() if fmt else None
        return QuantSpec(method, bits, group, bool(qc.get("desc_act", False)), fmt,
                         method == "gptq" and bool(qc.get("lm_head", False)))

    def describe(self) -> str:
        group = "per-channel" if self.group_size <= 0 else f"group {self.group_size}"
        extra = ", act-order" if self.desc_act else ""
        return f"{self.method.upper()} {self.bits}-bit ({group}{extra})"


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _resolve(model_config: ModelConfig, dtype: torch.dtype | str) -> torch.dtype:
    """Strings as EngineArgs takes them; 'auto' means what the engine picks on a GPU."""
    return resolve_dtype(dtype, torch.device("cuda"), model_config.torch_dtype)


def linear_bytes(in_features: int, out_features: int, act_bytes: int, quant: QuantSpec | None,
                 bias: bool = False) -> int:
    """Bytes of one linear layer as loaded: dense in the activation dtype, or packed + group scales/zeros
    (an act-order permutation is shared by the linears that read the same input: see estimate_weight_bytes)."""
    bias_bytes = out_features * act_bytes if bias else 0
    if quant is None:
        return in_features * out_features * act_bytes + bias_bytes
    group = in_features if quant.group_size <= 0 else quant.group_size
    num_groups = -(-in_features // group)
    packed = in_features * out_features * quant.bits // 8  # qweight
    scales_and_zeros = 2 * num_groups * out_features * act_bytes
    return packed + scales_and_zeros + bias_bytes


def layer_linear_shapes(mc: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """(name, in_features, out_features, has_bias) of every linear in one decoder layer."""
    q_out, kv_out = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    qkv_bias = mc.attention_bias
    o_bias = mc.attention_bias and mc.architecture != "Qwen2ForCausalLM"  # Qwen2: biases on q/k/v only
    mlp_bias = bool(mc.raw.get("mlp_bias", False))
    return [
        ("q_proj", mc.hidden_size, q_out, qkv_bias),
        ("k_proj", mc.hidden_size, kv_out, qkv_bias),
        ("v_proj", mc.hidden_size, kv_out, qkv_bias),
        ("o_proj", q_out, mc.hidden_size, o_bias),
        ("gate_proj", mc.hidden_size, mc.intermediate_size, mlp_bias),
        ("up_proj", mc.hidden_size, mc.intermediate_size, mlp_bias),
        ("down_proj", mc.intermediate_size, mc.hidden_size, mlp_bias),
    ]


def estimate_weight_bytes(model_config: ModelConfig, dtype: torch.dtype | str, lm_head_quantization: str = "none"
                          ) -> int:
    """Device bytes of all weights once loaded (see the module docstring for what is counted)."""
    mc = model_config
    act = dtype_bytes(_resolve(mc, dtype))
    quant = QuantSpec.from_config(mc.quantization_config)
    embed = mc.vocab_size * mc.hidden_size * act
    if quant is not None and quant.quantized_head:  # packed in the checkpoint, apart from a tied embedding
        lm_head = linear_bytes(mc.hidden_size, mc.vocab_size, act, quant, False)
        lm_head += 8 * mc.hidden_size if quant.desc_act else 0  # its act-order permutation
    elif lm_head_quantization == "int8":  # int8 rows and a scale each
        lm_head = mc.vocab_size * (mc.hidden_size + act)
    else:
        lm_head = 0 if mc.tie_word_embeddings else embed
    per_layer = sum(linear_bytes(i, o, act, quant, b) for _, i, o, b in layer_linear_shapes(mc))
    norm = 4 if mc.architecture == GEMMA3 else act  # Gemma's norms are held as float32 (1 + weight)
    per_layer += 2 * mc.hidden_size * norm  # input_layernorm + post_attention_layernorm
    per_layer += 2 * mc.hidden_size * norm if mc.architecture == GEMMA3 else 0  # pre/post_feedforward_layernorm
    per_layer += 2 * mc.head_dim * norm if mc.qk_norm else 0  # Qwen3's and Gemma's q_norm + k_norm
    if quant is not None and quant.desc_act:  # int64 permutations: qkv, o, gate_up, down inputs
        per_layer += 8 * (2 * mc.hidden_size + mc.num_heads * mc.head_dim + mc.intermediate_size)
    return embed + lm_head + mc.num_layers * per_layer + mc.hidden_size * norm  # + final norm


def kv_bytes_per_token(model_config: ModelConfig, dtype: torch.dtype | str) -> int:
    """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * element size."""
    mc = model_config
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype_bytes(_resolve(mc, dtype))


def estimate_activation_bytes(model_config: ModelConfig, dtype: torch.dtype | str, num_tokens: int = 2048,
                              max_num_seqs: int = 64, block_size: int = 16) -> int:
    """What the engine's memory profile (ModelRunner._profile_cuda) will count, before it runs.

    - The forward's peak is in the MLP: per token the residual, hidden and normed rows (3 * hidden) and the
      gate_up output + SwiGLU product (3 * intermediate) in the activation dtype; the logits row(s) in that
      dtype plus two float32 copies. The larger of a prefill of ``num_tokens`` (one logits row) and a decode
      step of ``max_num_seqs`` sequences (one row each).
    - cuBLAS's workspace (32 MiB on Hopper), allocated by the first matmul of the process.
    Against the engine's profiled peak on an H200 (fp16, 2048 tokens, fresh process, 8 GiB budget): SmolLM2-135M
    shape 107.9 MB profiled vs 113.0 MB here (both measured with the
    scratch KV of the profiling forward counted; the engine now subtracts it) (the decode-step term: 64 logits rows), Llama-2-7B shape (4 layers)
    353.4 vs 353.7 MB, Qwen2-7B shape (4 layers) 327.2 vs 328.7 MB; KV blocks 22,279 / 5,810 / 32,182 allocated
    vs 22,265 / 5,810 / 32,171 predicted.
    """
    mc = model_config
    act = dtype_bytes(_resolve(mc, dtype))
    per_token = (3 * mc.hidden_size + 3 * mc.intermediate_size) * act
    per_row = mc.vocab_size * (act + 8)
    seqs = min(max_num_seqs, num_tokens)
    forward = max(num_tokens * per_token + per_row, seqs * (per_token + per_row))
    return forward + CUBLAS_WORKSPACE_BYTES


def format_bytes(num: float) -> str:
    """GiB above 1 GiB, MiB above 1 MiB, else KiB: the unit people read on nvidia-smi."""
    if abs(num) >= GiB:
        return f"{num / GiB:.2f} GiB"
    if abs(num) >= MiB:
        return f"{num / MiB:.1f} MiB"
    return f"{num / 1024:.1f} KiB"


@dataclass(frozen=True)
class FitReport:
    """Where the memory budget goes and what context / concurrency is left for the KV cache."""

    weight_bytes: int
    kv_bytes_per_token: int
    activation_reserve_bytes: int
    budget_bytes: int
    kv_budget_bytes: int  # budget - weights - activation reserve (may be negative)
    block_size: int
    num_blocks: int  # whole KV blocks the engine can allocate
    max_context_tokens: int  # KV tokens available = num_blocks * block_size
    max_model_len: int
    max_concurrency: int  # full max_model_len requests held at once
    fits: bool
    message: str
    suggested_max_model_len: int | None = None

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache will actually allocate (whole blocks)."""
        return self.num_blocks * self.block_size * self.kv_bytes_per_token


def check_fit(model_config: ModelConfig, dtype: torch.dtype | str, budget_bytes: int,
              max_model_len: int | None = None, block_size: int = 16, *,
              max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
              activation_reserve_bytes: int | None = None, kv_cache_bytes: int | None = None,
              lm_head_quantization: str = "none") -> FitReport:
    """The fit report for a budget. ``kv_cache_bytes`` (an explicit KV budget, as on CPU) replaces the
    subtraction; ``activation_reserve_bytes`` (a profiled peak) replaces the estimate."""
    if block_size <= 0:
        raise EngineError("block_size must be positive", param="block_size")
    mc = model_config
    max_len = int(max_model_len or mc.max_position_embeddings)
    weights = estimate_weight_bytes(mc, dtype, lm_head_quantization)
    per_token = kv_bytes_per_token(mc, dtype)
    reserve = activation_reserve_bytes
    if reserve is None:
        reserve = estimate_activation_bytes(mc, dtype, min(max_num_batched_tokens, max_len), max_num_seqs,
                                            block_size)
    kv_budget = kv_cache_bytes if kv_cache_bytes is not None else budget_bytes - weights - reserve
    num_blocks = max(kv_budget, 0) // (per_token * block_size)
    blocks_per_request = -(-max_len // block_size)
    overflow = weights + reserve + (kv_cache_bytes or 0) > budget_bytes
    fits = not overflow and num_blocks >= blocks_per_request
    tokens = num_blocks * block_size
    suggestion = None if fits or overflow or tokens < block_size else tokens
    fields = {"weight_bytes": weights, "kv_bytes_per_token": per_token, "activation_reserve_bytes": reserve,
              "budget_bytes": budget_bytes, "kv_budget_bytes": kv_budget, "block_size": block_size,
              "num_blocks": num_blocks, "max_context_tokens": tokens, "max_model_len": max_len,
              "max_concurrency": num_blocks // blocks_per_request, "fits": fits,
              "suggested_max_model_len": suggestion}
    return FitReport(message=_message(mc, dtype, fields), **fields)


def require_fit(model_config: ModelConfig, dtype: torch.dtype | str, budget_bytes: int,
                max_model_len: int | None = None, block_size: int = 16, **kwargs) -> FitReport:
    """check_fit, raising EngineError(param='max_model_len') when one full-length request cannot be held."""
    report = check_fit(model_config, dtype, budget_bytes, max_model_len, block_size, **kwargs)
    if not report.fits:
        raise EngineError(report.message, param="max_model_len", code="model_does_not_fit")
    return report


def _message(mc: ModelConfig, dtype: torch.dtype | str, f: dict) -> str:
    quant = QuantSpec.from_config(mc.quantization_config)
    kind = quant.describe() if quant else str(_resolve(mc, dtype)).removeprefix("torch.")
    used = (f"weights {format_bytes(f['weight_bytes'])} ({kind}) and activation reserve "
            f"{format_bytes(f['activation_reserve_bytes'])} in a {format_bytes(f['budget_bytes'])} budget")
    kv = (f"{format_bytes(f['num_blocks'] * f['block_size'] * f['kv_bytes_per_token'])} of KV cache = "
          f"{f['max_context_tokens']:,} tokens at {format_bytes(f['kv_bytes_per_token'])} per token")
    need = -(-f["max_model_len"] // f["block_size"]) * f["block_size"] * f["kv_bytes_per_token"]
    length = f"max_model_len={f['max_model_len']:,}"
    if f["fits"]:
        return (f"fits: {used} leave {kv}; {length} allows {f['max_concurrency']} full-length "
                f"request(s) at once")
    if f["suggested_max_model_len"] is None:
        return (f"does not fit: {used} leave no room for the KV cache (one {length} request needs "
                f"{format_bytes(need)}). Use a 4-bit (AWQ/GPTQ) model or a larger budget "
                f"(--gpu-memory-utilization / --gpu-memory-limit)")
    return (f"does not fit: one {length} request needs {format_bytes(need)} of KV cache, but {used} leave "
            f"only {kv}. Use --max-model-len {f['suggested_max_model_len']} or less, a 4-bit model, "
            f"or a larger budget")
