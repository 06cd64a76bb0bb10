"""Rotary position tables (cos/sin cache) for every rope type the Hub uses, computed as transformers computes them.

Each builder mirrors one of transformers' ``ROPE_INIT_FUNCTIONS`` (modeling_rope_utils.py) op for op, so the
float32 tables come out bit-identical: it returns the inverse frequencies of the rotated dims and the attention
factor transformers multiplies cos and sin by. The table is indexed by position only, so the types whose
frequencies change with the length of a forward pass (dynamic NTK past ``max_position_embeddings``, LongRoPE
past ``original_max_position_embeddings``) are served up to that length only (``ModelConfig.context_limit``);
below it they are fixed tables: dynamic NTK's is the default one, LongRoPE's uses its short factors.
"""

from __future__ import annotations

import math

import torch

from engine.errors import EngineError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths scaled by ``factor``, short ones kept."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim // 2]


def _yarn(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between; cos/sin times mscale."""
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _dynamic(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Dynamic NTK at a sequence of max_position_embeddings (all transformers computes below that length):
    base * (factor * 1 - (factor - 1)) ** (dim / (dim - 2)), i.e. the default table."""
    factor = float(scaling["factor"])
    base = theta * ((factor * 1.0) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _longrope(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 ``longrope`` / ``su``) with its short factors; cos/sin times the attention factor."""
    short_factor = scaling.get("short_factor")
    if not isinstance(short_factor, list) or len(short_factor) != dim // 2:
        raise EngineError(f"rope_scaling short_factor must list {dim // 2} numbers (rotary dims / 2), got "
                          f"{short_factor if not isinstance(short_factor, list) else len(short_factor)}")
    if not isinstance(scaling.get("long_factor"), list) or len(scaling["long_factor"]) != dim // 2:
        raise EngineError(f"rope_scaling long_factor must list {dim // 2} numbers (rotary dims / 2)")
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(short_factor, dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * theta ** inv_freq_shape), float(attention_factor)


def rope_kind(scaling: dict | None) -> str:
    return "default" if scaling is None else (scaling.get("rope_type") or scaling.get("type") or "default")


def rope_parameters(dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2] float32, attention factor) of the rotated ``dim`` leading dims of a head."""
    kind = rope_kind(scaling)
    if kind == "default":
        return _default_inv_freq(dim, theta), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(_default_inv_freq(dim, theta), scaling), 1.0
    if kind == "linear":
        return _default_inv_freq(dim, theta) / float(scaling["factor"]), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling)
    if kind == "dynamic":
        return _dynamic(dim, theta, scaling), 1.0
    if kind == "longrope":
        return _longrope(dim, theta, scaling)
    raise EngineError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def cos_sin_cache(rotary_dim: int, max_positions: int, theta: float, scaling: dict | None,
                  device: torch.device) -> torch.Tensor:
    """[max_positions, rotary_dim] float32: cos of the half-dim frequencies, then sin (kernels/reference.py),
    both times the rope type's attention factor as transformers applies it (yarn, longrope)."""
    inv_freq, attention_factor = rope_parameters(rotary_dim, theta, scaling)  # [rotary_dim // 2]
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [max_positions, rotary_dim // 2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat([cos, sin], dim=-1).to(device)
