"""A one-sequence decode step in five launches per layer (single-stream decoding, issue 15).

One row of activations against every weight is bound by weight bandwidth and, on small models, by launches
(~1.3 us each inside a CUDA graph). The unfused layer is ten launches (norm, qkv, rotary, cache write,
attention, o, norm, gate/up, SiLU, down); here the one-row GEMV (kernels/triton/w4a16_gemv.py for packed int4
weights, kernels/triton/dense_gemv.py for fp16 ones) takes its neighbours: the RMSNorm in its prologue, rotary
+ the KV-cache write, the residual add or SiLU x up in its epilogue. What is left per layer: qkv, attention, o,
gate/up, down; after the last layer the final norm rides on the LM head's launch (the dense GEMV, whatever the
layers' format, over fp16 rows or the optional int8 ones).

The residual stream is one [1, hidden] tensor that the o and down launches add into in place; they also write
the new residual times the next RMSNorm's weight, which the next GEMV's dot reads instead of forming it in its
loop (it still takes the rms from the residual; the first layer's qkv, after the embedding, forms it itself).
The arithmetic is
that of the unfused ops up to fp16 rounding (``reference.w4a16_gemv`` composes them), so the reference backend
runs this path too and tests compare it with the unfused forward.
"""

from __future__ import annotations

import torch

from engine.config import GEMMA3
from engine.forward_batch import ForwardBatch
from engine.layers.linear import Int8Rows, Linear, PackedInt4
from kernels.reference import X16_PLANES
from kernels.triton.dense_gemv import dense_weight_unsupported
from kernels.triton.w4a16_gemv import gemv_large_matrix

LAYER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the fused layer's four GEMVs


def fused_decode_unsupported(model) -> str | None:
    """Why this model's one-row decode cannot use the fused layer (None when it can). Reads tensors: call at
    load time, not inside a graph capture."""
    cfg = model.config
    if model.tp is not None:
        return "tensor parallelism: the fused layer has no all-reduce after o and down"
    if cfg.architecture == GEMMA3:  # the epilogues implement Llama's layer: x + o(attn), SiLU, w * norm(x)
        return ("Gemma 3's layer (norms after attention and around the MLP, (1 + w) norms, GeGLU, two rope "
                "tables) is not the fused layer's")
    if model.embed_tokens.dtype != torch.float16:
        return "activations are not fp16"
    if cfg.head_dim & (cfg.head_dim - 1):
        return f"head_dim {cfg.head_dim} is not a power of two"
    if cfg.rotary_dim != cfg.head_dim:
        return f"partial rotary ({cfg.rotary_dim} of {cfg.head_dim} dims) is not in the fused qkv epilogue"
    head = (_linear_unsupported(model.lm_head) if isinstance(model.lm_head, Linear)
            else dense_weight_unsupported(*_head_weight(model.lm_head)))
    if head is not None:
        return f"lm_head: {head}"
    for layer in model.layers:
        for name in LAYER_LINEARS:
            reason = _linear_unsupported(getattr(layer, name))
            if reason is not None:
                return f"{name}: {reason}"
    return None


def _linear_unsupported(linear: Linear) -> str | None:
    if len(linear.parts) != 1:
        return "not one weight (a merged layer kept in parts)"
    weight = linear.parts[0]
    if isinstance(weight, torch.Tensor):  # dense [out, in]
        if weight.shape[0] % 8:
            return f"out_features {weight.shape[0]} not a multiple of 8 (the dense GEMV's gate/up tiles)"
        return dense_weight_unsupported(weight)
    if weight.group_size % 32 or weight.in_features % 32:
        return f"group size {weight.group_size} / in_features {weight.in_features} not multiples of 32"
    if not torch.equal(weight.zeros, weight.zeros.round()):
        return "zero points are not integers"
    return None


def x16_rows_supported(model) -> bool:
    """Whether the fused layer's int4 GEMVs read their rows in 16-bit fixed point (kernels/triton/w4a16_gemv.py's
    integer dot: 1.03-1.13x the half2 dot's speed on the 7B and 8B launches, BENCHMARKS.md issue 15, session 19):
    every linear packed int4 without act-order (x is read as given) and large enough for the GEMV's large-matrix
    plans, whose 128-column tiles let o, gate/up and down write the next row's planes (a 64-row block's scale is
    one tile's). Small models keep the half2 dot (SmolLM2's launches: 0.95-1.08x, one-step tiles of 32)."""
    for layer in model.layers:
        for name in LAYER_LINEARS:
            linear = getattr(layer, name)
            weight = linear.parts[0]
            if (len(linear.parts) != 1 or not isinstance(weight, PackedInt4) or weight.perm is not None
                    or not gemv_large_matrix(weight.in_features, weight.out_features)):
                return False
    return True


def _gemv(model, linear: Linear, x: torch.Tensor, **fused) -> torch.Tensor:
    weight = linear.parts[0]
    if isinstance(weight, PackedInt4):
        return model.backend.w4a16_gemv(x, weight.qweight, weight.scales, weight.zeros, weight.group_size,
                                        weight.perm, bias=linear.bias, **fused)
    return model.backend.dense_gemv(x, weight, bias=linear.bias, **fused)


@torch.inference_mode()
def decode_one_row(model, batch: ForwardBatch) -> torch.Tensor:
    """Logits [1, vocab] float32 of a decode step of one sequence (``batch`` has one token)."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    scale = cfg.attention_scale
    residual = model.embed_tokens[batch.input_ids]  # [1, hidden], updated in place by o and down
    layers = model.layers
    normed = torch.empty_like(residual)  # [1, hidden]: the next norm's x * weight, written by o and down
    rows = _x16_rows(model, residual.device)  # {} or the planes of normed and of silu(gate) * up
    for index, layer in enumerate(layers):
        k_cache, v_cache = model.kv_caches[index]
        rope = {"positions": batch.positions, "slot_mapping": batch.slot_mapping, "cos_sin_cache": model.cos_sin_cache,
                "k_cache": k_cache, "v_cache": v_cache, "q_size": q_size, "kv_size": kv_size,
                "head_dim": cfg.head_dim}
        if layer.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before rotary, in the same epilogue
            rope.update(q_norm=layer.q_norm, k_norm=layer.k_norm, eps=eps)
        q = _gemv(model, layer.qkv_proj, residual, norm_weight=layer.input_layernorm, eps=eps,
                  normed=normed if index else None, rope=rope,
                  **_reads(rows, "normed", index > 0))  # [1, q_size]; layer 0 forms x * weight itself
        attn = model.backend.paged_decode_attention(q.view(1, cfg.num_heads, cfg.head_dim), k_cache, v_cache,
                                                    batch.block_tables, batch.context_lens, scale,
                                                    cfg.window_of(index))
        _gemv(model, layer.o_proj, attn.reshape(1, q_size), residual=residual,
              next_norm=(layer.post_attention_layernorm, normed), **_writes(rows, "normed", True))
        act = _gemv(model, layer.gate_up_proj, residual, norm_weight=layer.post_attention_layernorm, eps=eps,
                    normed=normed, silu=True, **_reads(rows, "normed", True),
                    **_writes(rows, "act", True))  # [1, intermediate]
        last = index + 1 == len(layers)  # the last down writes the final norm's input for the head
        _gemv(model, layer.down_proj, act, residual=residual,
              next_norm=(model.norm if last else layers[index + 1].input_layernorm, normed),
              **_reads(rows, "act", True), **_writes(rows, "normed", not last))
    if isinstance(model.lm_head, Linear):  # packed int4 (GPTQ lm_head: true): the int4 GEMV, the norm fused alike
        return _gemv(model, model.lm_head, residual, norm_weight=model.norm, eps=eps, normed=normed).float()
    weight, row_scales = _head_weight(model.lm_head)
    logits = model.backend.dense_gemv(residual, weight, norm_weight=model.norm, eps=eps, normed=normed,
                                      row_scales=row_scales)
    return logits.float()  # [1, vocab]


def _head_weight(head: torch.Tensor | Int8Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    # the LM head as the dense GEMV reads it: (fp16 weight, None) or (int8 codes, their row scales)
    if isinstance(head, Int8Rows):
        return head.qweight, head.scales
    return head, None


def _x16_rows(model, device: torch.device) -> dict:
    """The step's planes of the rows the int4 GEMVs read in 16-bit fixed point (``x16_rows_supported``): "normed"
    (the next norm's input, written by o and down) and "act" (silu(gate) * up, written by gate/up), int32
    [X16_PLANES, width / 8]; {} where the layer keeps the half2 dot."""
    if not model.one_row_x16:
        return {}
    cfg = model.config
    return {"normed": torch.empty((X16_PLANES, cfg.hidden_size // 8), dtype=torch.int32, device=device),
            "act": torch.empty((X16_PLANES, cfg.intermediate_size // 8), dtype=torch.int32, device=device)}


def _reads(rows: dict, name: str, ready: bool) -> dict:
    # a GEMV's x16 argument: the planes ``name`` where they were written for it
    return {"x16": rows[name]} if rows and ready else {}


def _writes(rows: dict, name: str, needed: bool) -> dict:
    # a GEMV's x16_out argument: the planes ``name`` where a later launch reads them
    return {"x16_out": rows[name]} if rows and needed else {}
