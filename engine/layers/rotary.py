"""Rotary position tables (cos/sin cache) including Llama 3's and linear rope scaling."""

from __future__ import annotations

import math

import torch

from engine.errors import EngineError


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


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = None if scaling is None else (scaling.get("rope_type") or scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    raise EngineError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def cos_sin_cache(head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                  device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the half-dim frequencies, then sin (kernels/reference.py)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)  # [head_dim // 2]
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
