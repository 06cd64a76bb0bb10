"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/4): forward over a ForwardBatch, paged KV.
Gemma 3 subclasses it (engine/models/gemma3.py).

Weights are plain tensors / ``Linear`` objects filled by engine/model_loader.py; every op goes through the
``Backend`` (Triton on CUDA, torch reference elsewhere). The model holds no per-request state: the KV
cache tensors are bound once by the model runner and addressed through the batch's slot mapping.
Under tensor parallelism (``tp``) each rank holds its shard (engine/model_loader.py): the config's head counts
and MLP width are the rank's, o/down all-reduce their output (``RowParallelLinear``), the embedding sums the
ranks' vocabulary slices and the head gathers them.
The families differ in two places of attention only: Qwen3 RMS-normalizes each q and k head before rotary
(``DecoderLayer.q_norm`` / ``k_norm``), and Phi-4-mini rotates the first ``config.rotary_dim`` dims of a head
(the cos/sin cache is that wide). Phi-3's fused checkpoint projections are the merged ``Linear`` loaded as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.layers.linear import Int8Rows, Linear, head_logits
from engine.models.fused_decode import decode_one_row
from engine.parallel import TPGroup
from kernels.ops import Backend


@dataclass
class DecoderLayer:
    input_layernorm: torch.Tensor  # [hidden]
    qkv_proj: Linear  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim
    o_proj: Linear
    post_attention_layernorm: torch.Tensor
    gate_up_proj: Linear  # hidden -> 2 * intermediate
    down_proj: Linear
    q_norm: torch.Tensor | None = None  # [head_dim]: Qwen3's per-head RMSNorm of q before rotary
    k_norm: torch.Tensor | None = None  # [head_dim]: the same for k
    # Gemma 3 (engine/models/gemma3.py): the RMSNorms before and after the MLP; there every norm of the layer
    # holds 1 + weight in float32 and post_attention_layernorm normalizes the attention output
    pre_feedforward_layernorm: torch.Tensor | None = None  # [hidden]
    post_feedforward_layernorm: torch.Tensor | None = None  # [hidden]

    def norms(self) -> list[torch.Tensor]:
        """Every norm weight the layer has."""
        return [t for t in (self.input_layernorm, self.post_attention_layernorm, self.q_norm, self.k_norm,
                            self.pre_feedforward_layernorm, self.post_feedforward_layernorm) if t is not None]


@dataclass
class LlamaModel:
    config: ModelConfig
    backend: Backend
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[DecoderLayer]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor | Int8Rows | Linear  # [vocab, hidden] (the embedding itself when tied), its int8 rows,
    # or packed int4 (a GPTQ checkpoint's lm_head: true)
    cos_sin_cache: torch.Tensor  # [max_positions, rotary_dim] float32
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    fuse_one_row_decode: bool = False  # one-sequence decode steps run engine/models/fused_decode.py
    one_row_x16: bool = False  # ... with the int4 GEMVs' rows in 16-bit fixed point (fused_decode.x16_rows_supported)
    tp: TPGroup | None = None  # the tensor-parallel group this rank's shard belongs to (None: the whole model)
    vocab_start: int = 0  # tensor parallel: the first token id of this rank's embedding and head rows

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Attach per-layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
        assert len(kv_caches) == len(self.layers)
        self.kv_caches = kv_caches

    def attention(self, index: int, layer: DecoderLayer, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = layer.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q = qkv[:, :q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q, k = self.normalize_heads(layer, q, k)
        q, k = self.rotate(batch.positions, q, k, self.rope_table(index))
        k_cache, v_cache = self.kv_caches[index]
        self.backend.reshape_and_cache(k, v, k_cache, v_cache, batch.slot_mapping)
        scale = cfg.attention_scale
        window = cfg.window_of(index)
        if batch.is_decode:
            out = self.backend.paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                                      scale, window)
        else:
            out = self.backend.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.query_start_loc,
                                               batch.context_lens, scale, window)
        return layer.o_proj(out.reshape(num_tokens, q_size))  # [num_tokens, hidden]

    def normalize_heads(self, layer: DecoderLayer, q: torch.Tensor, k: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's q/k norms: the model's RMSNorm op over rows of one head each, so the GPU runs its kernel."""
        eps = self.config.rms_norm_eps
        head_dim = q.shape[-1]
        q_rows, _ = self.backend.rms_norm(q.reshape(-1, head_dim), layer.q_norm, eps)  # [tokens * heads, head_dim]
        k_rows, _ = self.backend.rms_norm(k.reshape(-1, head_dim), layer.k_norm, eps)
        return q_rows.view(q.shape), k_rows.view(k.shape)

    def rope_table(self, index: int) -> torch.Tensor:
        """The cos/sin table layer ``index`` rotates by (one for every layer here; Gemma 3 has two)."""
        return self.cos_sin_cache

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary by ``table`` [max_positions, rotary_dim] on the first ``rotary_dim`` dims of each head (all of
        them but for partial rotary); the rest passes through, as transformers' Phi-3 does."""
        rotary_dim = table.shape[-1]
        if rotary_dim == q.shape[-1]:
            return self.backend.rotary_embedding(positions, q, k, table)
        q_rot, k_rot = self.backend.rotary_embedding(positions, q[..., :rotary_dim], k[..., :rotary_dim],
                                                     table)  # [tokens, heads, rotary_dim]
        return torch.cat([q_rot, q[..., rotary_dim:]], dim=-1), torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)

    def mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        return layer.down_proj(self.backend.silu_and_mul(layer.gate_up_proj(x)))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns logits [num_sampled, vocab] in float32 for the rows in ``batch.logits_indices``."""
        if self.fuse_one_row_decode and batch.is_decode and batch.input_ids.shape[0] == 1:
            return decode_one_row(self, batch)
        eps = self.config.rms_norm_eps
        hidden = self.embed(batch.input_ids)  # [num_tokens, hidden]
        residual = None
        for index, layer in enumerate(self.layers):
            x, residual = self.backend.rms_norm(hidden, layer.input_layernorm, eps, residual)
            hidden = self.attention(index, layer, x, batch)
            x, residual = self.backend.rms_norm(hidden, layer.post_attention_layernorm, eps, residual)
            hidden = self.mlp(layer, x)
        hidden, _ = self.backend.rms_norm(hidden, self.norm, eps, residual)
        selected = hidden[batch.logits_indices]  # [num_sampled, hidden]
        return self.logits(selected)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows [num_tokens, hidden]; under tensor parallelism each rank looks up the ids of its
        vocabulary slice (zeros for the others) and the all-reduce sums them."""
        if self.tp is None:
            return self.embed_tokens[input_ids]
        local = input_ids - self.vocab_start  # [num_tokens]
        outside = (local < 0) | (local >= self.embed_tokens.shape[0])
        rows = self.embed_tokens[local.clamp(0, self.embed_tokens.shape[0] - 1)]  # [num_tokens, hidden]
        return self.tp.all_reduce(rows.masked_fill_(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [num_sampled, vocab] float32 of the rows ``hidden`` [num_sampled, hidden]; under tensor
        parallelism the ranks' vocabulary slices are gathered (padding columns of the last slice dropped)."""
        logits = head_logits(self.backend, hidden, self.lm_head)  # [num_sampled, vocab or vocab slice]
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits)[:, :self.config.vocab_size]
        return logits.float()

    def weight_bytes(self) -> int:
        tensors = [self.embed_tokens, self.norm] + ([] if self.lm_head is self.embed_tokens else [self.lm_head])
        total = sum(t.nbytes() if isinstance(t, (Int8Rows, Linear)) else t.numel() * t.element_size()
                    for t in tensors)
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for t in layer.norms())
            total += sum(lin.nbytes() for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
        return total
