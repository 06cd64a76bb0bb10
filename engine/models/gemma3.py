"""Gemma 3 text decoder (Gemma3ForCausalLM): the Llama decoder's attention with Gemma's layer around it.

What differs from Llama, each as transformers' modeling_gemma3.py computes it:
- every RMSNorm scales by ``1 + weight`` in float32 and rounds to the activation dtype after the scale
  (Gemma3RMSNorm); the loader stores ``1 + weight`` in float32 (``unit_offset_norm_weight``) and
  ``gemma_rms_norm`` runs the backend's RMSNorm on a float32 row, so nothing is rounded before the weight;
- the layer normalizes the attention output (post_attention_layernorm) and the MLP's input and output
  (pre/post_feedforward_layernorm) before each residual add, so the adds are plain adds in the activation dtype;
- embeddings are multiplied by sqrt(hidden_size) rounded to the activation dtype; the MLP is GeGLU
  (gelu tanh-approximated on the gate, times up); the head is tied;
- the attention scale is ``query_pre_attn_scalar ** -0.5``; sliding layers rotate by a table of the local base
  (``rope_local_base_freq``), global layers by the global one with its scaling;
- logits may be soft-capped: ``tanh(logits / cap) * cap``, in the activation dtype like transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.layers.linear import head_logits
from engine.models.llama import DecoderLayer, LlamaModel
from kernels.ops import Backend


def unit_offset_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's stored norm weight [n] (in the activation dtype) -> the float32 scale 1 + weight it applies."""
    return 1.0 + weight.float()


def gemma_rms_norm(backend: Backend, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm of rows x [rows, n]: (x / rms(x)) * scale in float32, then rounded to x's dtype.

    The backend's RMSNorm rounds the normalized row to its input's dtype before the weight (Llama's order); fed a
    float32 row and the float32 ``scale`` it computes Gemma's order exactly, with no kernel of its own.
    """
    out, _ = backend.rms_norm(x.float(), scale, eps)  # [rows, n] float32
    return out.to(x.dtype)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(logits / cap) * cap (Gemma's final_logit_softcapping); logits unchanged when cap is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


@dataclass
class Gemma3Model(LlamaModel):
    """``cos_sin_cache`` is the global layers' table, ``local_cos_sin_cache`` the sliding layers'."""

    local_cos_sin_cache: torch.Tensor | None = None  # [max_positions, head_dim] float32
    embed_normalizer: torch.Tensor | None = None  # [] sqrt(hidden_size) in the embedding dtype (set at init)

    def __post_init__(self) -> None:
        # transformers: torch.tensor(hidden ** 0.5) (float32) cast to the embedding dtype; made once, on the device,
        # so a captured step copies nothing from the host
        normalizer = torch.tensor(self.config.hidden_size ** 0.5)
        self.embed_normalizer = normalizer.to(self.embed_tokens.device, self.embed_tokens.dtype)

    def rope_table(self, index: int) -> torch.Tensor:
        return self.local_cos_sin_cache if self.config.uses_local_rope(index) else self.cos_sin_cache

    def rms_norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(self.backend, x, scale, self.config.rms_norm_eps)

    def normalize_heads(self, layer: DecoderLayer, q: torch.Tensor, k: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_norm / k_norm over each head's row, Gemma's norm (before rotary, like Qwen3's)."""
        head_dim = q.shape[-1]
        q_rows = self.rms_norm(q.reshape(-1, head_dim), layer.q_norm)  # [tokens * heads, head_dim]
        k_rows = self.rms_norm(k.reshape(-1, head_dim), layer.k_norm)
        return q_rows.view(q.shape), k_rows.view(k.shape)

    def mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up from the one merged projection."""
        gate, up = layer.gate_up_proj(x).chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return layer.down_proj(torch.nn.functional.gelu(gate, approximate="tanh") * up)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows times sqrt(hidden_size), the factor rounded to the embedding dtype as transformers does."""
        return self.embed_tokens[input_ids] * self.embed_normalizer  # [num_tokens, hidden]

    def layer_forward(self, index: int, layer: DecoderLayer, hidden: torch.Tensor, batch: ForwardBatch
                      ) -> torch.Tensor:
        """Gemma3DecoderLayer: hidden + post_norm(attention(norm(hidden))), then the same around the MLP."""
        attn = self.attention(index, layer, self.rms_norm(hidden, layer.input_layernorm), batch)
        hidden = hidden + self.rms_norm(attn, layer.post_attention_layernorm)
        mlp = self.mlp(layer, self.rms_norm(hidden, layer.pre_feedforward_layernorm))
        return hidden + self.rms_norm(mlp, layer.post_feedforward_layernorm)  # [num_tokens, hidden]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns logits [num_sampled, vocab] in float32 for the rows in ``batch.logits_indices``."""
        hidden = self.embed(batch.input_ids)  # [num_tokens, hidden]
        for index, layer in enumerate(self.layers):
            hidden = self.layer_forward(index, layer, hidden, batch)
        selected = self.rms_norm(hidden[batch.logits_indices], self.norm)  # [num_sampled, hidden]
        logits = head_logits(self.backend, selected, self.lm_head)  # [num_sampled, vocab]
        return soft_cap(logits, self.config.final_logit_softcapping).float()
