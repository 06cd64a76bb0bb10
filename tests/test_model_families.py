"""Issue 18: Qwen3 and Phi-3/Phi-4, and the rope scaling types of the Hub, against HF transformers token by token.

Every checkpoint is written by transformers' own config and model classes (random weights, a word-level
tokenizer) and read back by both sides from the same folder, so the engine and transformers see one
config.json. On CPU in float32 the engine's greedy tokens must equal transformers' greedy ``generate``
exactly (prompts up to 130 tokens, chunked by a 64-token step budget), its prefill logits must agree to
float32 noise, and its rotary tables must be transformers' own. What the engine cannot run exactly is
refused with an EngineError that says why. The 4-bit loader reads an AWQ build of Qwen3 made by our quantizer
and AWQ / GPTQ builds of Phi-3 whose fused qkv_proj / gate_up_proj are quantized as one matrix each; each must
generate what transformers generates on the checkpoint's dequantized weights (engine/quant/evaluate.py).
The GPU variants run real layer shapes (Qwen3-8B, Phi-3-mini, Phi-4-mini; two layers) with the Triton
kernels in fp16, judged the way tests/test_gpu_engine.py judges the Llama shapes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_gpu_engine import fp16_ulp, hf_greedy, hf_logprobs_along, random_prompts, write_word_tokenizer

from engine import LLM, SamplingParams
from engine.config import ModelConfig, check_context_limit
from engine.errors import EngineError
from engine.forward_batch import ForwardBatch
from engine.layers.linear import PackedInt4
from engine.layers.rotary import cos_sin_cache, rope_parameters
from engine.model_loader import load_model
from engine.models.fused_decode import fused_decode_unsupported
from kernels.ops import Backend

VOCAB = 256
COMMON = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.1}
LAYERS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512}
QWEN3_TINY = {**LAYERS, "head_dim": 32}  # head_dim != hidden / heads, as in Qwen3
PHI3_TINY = {**LAYERS, "original_max_position_embeddings": 512}


def longrope(rotary_dim: int) -> dict:
    """A LongRoPE dict like Phi-3.5 / Phi-4-mini's (legacy ``rope_scaling`` form), factors spread enough to matter."""
    half = rotary_dim // 2
    return {"type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + i for i in range(half)]}


VARIANTS = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),  # Qwen3-0.6B/1.7B/4B tie their head
    "phi3": ("phi3", {}),  # Phi-3-mini-4k's form: no rope scaling, whole-head rotary
    # Phi-4-mini's form: rotary on 12 of 16 dims, LongRoPE (served up to original_max_position_embeddings), tied
    "phi4-mini": ("phi3", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True,
                           "max_position_embeddings": 1024, "original_max_position_embeddings": 256,
                           "rope_scaling": longrope(12)}),
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
YARN_OPTIONS = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16,
                "beta_slow": 2, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
ROPE_CASES = {
    "linear": ("qwen3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # served up to max_position_embeddings (160), where transformers never grows the base
    "dynamic": ("qwen3", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 160}),
    "yarn": ("qwen3", {"rope_scaling": YARN}),
    "yarn-options": ("qwen3", {"rope_scaling": YARN_OPTIONS}),
    "llama3": ("qwen3", {"rope_scaling": LLAMA3}),
    "longrope": ("phi3", {"max_position_embeddings": 1024, "original_max_position_embeddings": 256,
                          "rope_scaling": longrope(16)}),
}
PROMPT_LENGTHS = (5, 40, 70, 130)


def build_checkpoint(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A random-weight checkpoint written by transformers (safetensors) with a word-level tokenizer."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    config_cls, model_cls, shape = {"qwen3": (Qwen3Config, Qwen3ForCausalLM, QWEN3_TINY),
                                    "phi3": (Phi3Config, Phi3ForCausalLM, PHI3_TINY),
                                    "mistral": (MistralConfig, MistralForCausalLM, LAYERS),
                                    "qwen2": (Qwen2Config, Qwen2ForCausalLM, LAYERS),
                                    "llama": (LlamaConfig, LlamaForCausalLM, LAYERS)}[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**shape, **COMMON, **overrides}))
    with torch.no_grad():  # norms start at one and biases at zero: make every norm weight and bias count
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    write_word_tokenizer(folder, overrides.get("vocab_size", VOCAB))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> folder of VARIANTS / ROPE_CASES, built once per module on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            family, overrides = {**VARIANTS, **ROPE_CASES}[name]
            built[name] = build_checkpoint(tmp_path_factory.mktemp(name), family, **overrides)
        return built[name]

    return get


def prompts_of(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def transformers_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` in float32, never stopping at EOS (the engine runs with ignore_eos)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return _generate(hf, prompts, max_new_tokens)


def _generate(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    hf.generation_config.eos_token_id = None
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                              pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def engine_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, **engine_args) -> list[list[int]]:
    """The offline engine on CPU in float32; a 64-token step budget chunks the longer prompts and mixes the
    chunks with other sequences' decodes."""
    args = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "16MiB", "max_num_batched_tokens": 64}
    llm = LLM(str(model_dir), **{**args, **engine_args})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def engine_prefill_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill of ``ids`` through the engine's model (reference kernels)."""
    cfg, n = model.config, len(ids)
    num_blocks = -(-n // block_size)
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    dtype = model.embed_tokens.dtype
    model.bind_kv_caches([(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.layers])
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], query_start_loc=torch.tensor([0, n]),
        context_lens=torch.tensor([n], dtype=torch.int32), logits_indices=torch.arange(n), is_decode=False)
    return model.forward(batch)


def load_cpu(model_dir: Path, max_positions: int = 256):
    return load_model(model_dir, torch.device("cpu"), torch.float32, Backend(use_triton=False), max_positions)


# ---- the families ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(checkpoint, variant):
    folder = checkpoint(variant)
    prompts = prompts_of(PROMPT_LENGTHS)
    assert engine_greedy(folder, prompts, 10) == transformers_greedy(folder, prompts, 10)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(checkpoint, variant):
    from transformers import AutoModelForCausalLM

    folder = checkpoint(variant)
    ids = prompts_of((130,), seed=2)[0]
    ours = engine_prefill_logits(load_cpu(folder), ids)  # [130, vocab]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert theirs.std().item() > 0.1  # logits that differ between tokens: the comparison can fail


def test_family_layers_are_loaded_as_the_checkpoint_has_them(checkpoint):
    qwen3 = load_cpu(checkpoint("qwen3"))
    cfg = qwen3.config
    assert cfg.qk_norm and cfg.head_dim == 32 and not cfg.attention_bias
    layer = qwen3.layers[0]
    assert layer.q_norm.shape == (32,) and layer.k_norm.shape == (32,)
    assert layer.qkv_proj.out_features == (4 + 2 * 2) * 32 and layer.qkv_proj.bias is None
    assert qwen3.lm_head is not qwen3.embed_tokens
    tied = load_cpu(checkpoint("qwen3-tied"))
    assert tied.lm_head is tied.embed_tokens

    phi4 = load_cpu(checkpoint("phi4-mini"))
    cfg = phi4.config
    assert cfg.fused_projections and cfg.head_dim == 16 and cfg.rotary_dim == 12
    assert phi4.cos_sin_cache.shape == (256, 12)
    assert phi4.layers[0].qkv_proj.out_features == (4 + 2 * 2) * 16 and phi4.layers[0].q_norm is None
    assert phi4.layers[0].gate_up_proj.out_features == 2 * 128
    assert phi4.lm_head is phi4.embed_tokens


def test_longrope_model_serves_its_original_length_and_refuses_more(checkpoint):
    folder = checkpoint("phi4-mini")
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="16MiB")
    assert llm.engine.max_model_len == 256  # original_max_position_embeddings, not max_position_embeddings 1024
    del llm
    with pytest.raises(EngineError, match="LongRoPE.*use --max-model-len 256 or less") as err:
        LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="16MiB", max_model_len=512)
    assert err.value.param == "max_model_len"


@pytest.mark.parametrize("family, window, overrides", [
    ("mistral", 16, {}),  # Mistral-7B-v0.1's form: every layer windowed (4,096 there)
    ("phi3", 24, {}),  # Phi-3-mini-4k's (2,047 there)
    ("qwen2", 16, {"use_sliding_window": True, "max_window_layers": 1}),  # only the layers from max_window_layers
    ("qwen3", 16, {"use_sliding_window": True, "max_window_layers": 1}),
])
def test_sliding_window_matches_transformers_past_the_window(tmp_path, family, window, overrides):
    """Prompts and generations several windows long: keys further back than the window drop out of attention in
    prefill, chunked prefill (64-token steps) and decode, as transformers masks them; the context is not capped."""
    folder = build_checkpoint(tmp_path / family, family, sliding_window=window, **overrides)
    cfg = ModelConfig.from_path(folder)
    windowed = [cfg.window_of(i) for i in range(cfg.num_layers)]
    assert windowed == ([0, window] if "max_window_layers" in overrides else [window, window])
    assert cfg.context_limit is None or cfg.context_limit.tokens > 512
    prompts = prompts_of((9, 40, 70, 130))
    assert engine_greedy(folder, prompts, 24) == transformers_greedy(folder, prompts, 24)


def test_llama_attention_and_mlp_biases_match_transformers(tmp_path):
    """Llama's attention_bias puts biases on q, k, v and o, its mlp_bias on gate, up and down: all are loaded."""
    folder = build_checkpoint(tmp_path / "llama-bias", "llama", attention_bias=True, mlp_bias=True)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.down_proj.bias"} <= names
    prompts = prompts_of((9, 70))
    assert engine_greedy(folder, prompts, 12) == transformers_greedy(folder, prompts, 12)


def test_sliding_window_changes_the_tokens(tmp_path):
    """The same weights without their window give other tokens past it (so the test above can fail)."""
    folder = build_checkpoint(tmp_path / "mistral", "mistral", sliding_window=16)
    prompts = prompts_of((70, 130))
    windowed = engine_greedy(folder, prompts, 24)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    assert engine_greedy(folder, prompts, 24) != windowed


# ---- rope scaling types ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_scaling_matches_transformers(checkpoint, case):
    """The inverse frequencies and attention factor are transformers' own (bit for bit), the tables agree to
    float32 rounding of cos/sin, and greedy tokens through the engine are transformers' tokens."""
    from transformers import AutoModelForCausalLM

    folder = checkpoint(case)
    cfg = ModelConfig.from_path(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    rotary = hf.model.rotary_emb
    inv_freq, attention_factor = rope_parameters(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(inv_freq, rotary.original_inv_freq)
    assert attention_factor == rotary.attention_scaling
    served = min(cfg.max_position_embeddings, 256)
    positions = torch.arange(served)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, served, rotary_dim]
    table = cos_sin_cache(cfg.rotary_dim, served, cfg.rope_theta, cfg.rope_scaling, torch.device("cpu"))
    half = cfg.rotary_dim // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], rtol=0, atol=2e-7)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], rtol=0, atol=2e-7)
    prompts = prompts_of((40, 130))
    assert engine_greedy(folder, prompts, 8) == _generate(hf, prompts, 8)


def test_rope_scaling_is_not_the_default_table(checkpoint):
    """The cases above would pass vacuously if a type fell back to plain rope: each table differs from it."""
    for case in ROPE_CASES:
        if case == "dynamic":
            continue  # below max_position_embeddings dynamic NTK is the default table (transformers too)
        cfg = ModelConfig.from_path(checkpoint(case))
        scaled = cos_sin_cache(cfg.rotary_dim, 200, cfg.rope_theta, cfg.rope_scaling, torch.device("cpu"))
        plain = cos_sin_cache(cfg.rotary_dim, 200, cfg.rope_theta, None, torch.device("cpu"))
        assert (scaled - plain).abs().max().item() > 1e-3, case


def test_dynamic_ntk_refuses_contexts_where_transformers_rescales(checkpoint):
    folder = checkpoint("dynamic")
    assert ModelConfig.from_path(folder).max_position_embeddings == 160
    with pytest.raises(EngineError, match="dynamic NTK.*--max-model-len 160"):
        LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="16MiB", max_model_len=320)


# ---- configs as the Hub publishes them ---------------------------------------------------------------------


def hub_config(arch: str, **fields) -> dict:
    base = {"architectures": [arch], "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064, "rope_theta": 10000.0}
    return {**base, **fields}


def test_phi35_mini_config_is_read_as_transformers_reads_it():
    cfg = ModelConfig.from_dict(hub_config("Phi3ForCausalLM", max_position_embeddings=131072,
                                           original_max_position_embeddings=4096, sliding_window=262144,
                                           rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                                                         "long_factor": [2.0] * 48}))
    assert cfg.fused_projections and cfg.rotary_dim == cfg.head_dim == 96
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["factor"] == 32.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.max_position_embeddings == 4096 and cfg.context_limit.tokens == 4096
    check_context_limit(cfg, 4096)
    with pytest.raises(EngineError, match="LongRoPE"):
        check_context_limit(cfg, 4097)


def test_phi4_mini_and_su_configs():
    phi4 = ModelConfig.from_dict(hub_config("Phi3ForCausalLM", num_attention_heads=24, num_key_value_heads=8,
                                            vocab_size=200064, tie_word_embeddings=True, partial_rotary_factor=0.75,
                                            max_position_embeddings=131072, original_max_position_embeddings=4096,
                                            rope_scaling=longrope(96)))
    assert phi4.head_dim == 128 and phi4.rotary_dim == 96 and phi4.max_position_embeddings == 4096
    # the old name: transformers keeps rope_scaling's original length under "su" (the top level under "longrope")
    su = ModelConfig.from_dict(hub_config("Phi3ForCausalLM", max_position_embeddings=131072,
                                          original_max_position_embeddings=8192,
                                          rope_scaling={**longrope(96), "type": "su",
                                                        "original_max_position_embeddings": 4096}))
    assert su.rope_scaling["rope_type"] == "longrope" and su.max_position_embeddings == 4096
    window = ModelConfig.from_dict(hub_config("Phi3ForCausalLM", max_position_embeddings=4096, sliding_window=2047))
    assert window.max_position_embeddings == 4096 and window.window_of(0) == 2047


def test_llama3_rope_without_its_original_length_uses_max_positions_as_transformers_does():
    # transformers 5 writes the resolved field into config.json; older configs may lack it
    scaling = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    cfg = ModelConfig.from_dict(hub_config("LlamaForCausalLM", max_position_embeddings=131072, rope_scaling=scaling))
    assert cfg.rope_scaling["original_max_position_embeddings"] == 131072


def test_qwen3_sliding_window_only_where_transformers_applies_it():
    qwen = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 2,
                "max_position_embeddings": 40960, "sliding_window": 4096, "max_window_layers": 1}
    assert ModelConfig.from_dict(hub_config("Qwen3ForCausalLM", **qwen)).layer_windows == ()  # window not in use
    windowed = ModelConfig.from_dict(hub_config("Qwen3ForCausalLM", **qwen, use_sliding_window=True))
    assert windowed.layer_windows == (0, 4096) and windowed.max_position_embeddings == 40960 and windowed.qk_norm
    all_full = ModelConfig.from_dict(hub_config("Qwen3ForCausalLM", **qwen, use_sliding_window=True,
                                                layer_types=["full_attention"] * 2))
    assert all_full.layer_windows == () and all_full.max_position_embeddings == 40960


@pytest.mark.parametrize("arch, fields, message", [
    ("Qwen3ForCausalLM", {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias true"),
    ("Qwen3ForCausalLM", {"partial_rotary_factor": 0.5}, "only Phi-3 rotates part of a head"),
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("Phi3ForCausalLM", {"rope_scaling": {**longrope(96), "type": "su"}},
     "'su' needs original_max_position_embeddings"),
    ("Gemma2ForCausalLM", {}, "unsupported architecture"),  # Gemma 3 runs (tests/test_gemma3.py)
])
def test_configs_pagoda_cannot_run_exactly_are_refused(arch, fields, message):
    with pytest.raises(EngineError, match=message):
        ModelConfig.from_dict(hub_config(arch, **fields))


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "proportional", "factor": 1.0}, "unsupported rope_scaling type 'proportional'"),
    ({"rope_type": "mrope", "mrope_section": [8, 4, 4]}, "unsupported rope_scaling type 'mrope'"),
    ({**longrope(32), "short_factor": [1.0] * 5, "rope_type": "longrope", "factor": 2.0,
      "original_max_position_embeddings": 128}, "short_factor must list 16 numbers"),
])
def test_unsupported_rope_is_refused_before_the_weights_load(checkpoint, tmp_path, scaling, message):
    folder = tmp_path / "model"
    shutil.copytree(checkpoint("qwen3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **scaling}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")  # never read: the rope table is refused first
    with pytest.raises(EngineError, match=message):
        LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="16MiB")


# ---- AWQ builds --------------------------------------------------------------------------------------------


def write_rtn_checkpoint(src: Path, out: Path, group_size: int, method: str = "awq",
                         quantize_head: bool = False) -> Path:
    """An AutoAWQ-GEMM or AutoGPTQ (v1) checkpoint of ``src`` by plain rounding, every decoder linear as stored
    in ``src`` (Phi-3's fused qkv_proj and gate_up_proj as one matrix each, as AutoAWQ and GPTQModel pack them);
    ``quantize_head`` (GPTQ): lm_head packed too, as GPTQModel's ``lm_head=True`` writes it."""
    from safetensors.torch import load_file, save_file

    from engine.quant.awq import AWQMethod, awq_tensors
    from engine.quant.gptq import GPTQMethod, gptq_tensors
    from engine.quant.rtn import quantize_grouped

    out.mkdir(parents=True)
    tensors = {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        prefix = name.removesuffix(".weight")
        packed_head = quantize_head and name == "lm_head.weight"
        if not (name.startswith("model.layers.") and prefix.endswith("_proj")) and not packed_head:
            tensors[name] = value.half()
            continue
        if method == "awq":
            packed = awq_tensors(*quantize_grouped(value.float(), group_size))
        else:  # v1 stores zero - 1, so zeros start at 1
            codes, scales, zeros = quantize_grouped(value.float(), group_size, min_zero=1)
            packed = gptq_tensors(codes, scales, zeros, torch.arange(value.shape[1]) // group_size)
        tensors.update({f"{prefix}.{key}": tensor for key, tensor in packed.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    quant = (AWQMethod(4, group_size) if method == "awq"
             else GPTQMethod(4, group_size, sym=False, quantized_head=quantize_head))
    config = json.loads((src / "config.json").read_text())
    config.update(quantization_config=quant.config_dict(), dtype="float16")
    (out / "config.json").write_text(json.dumps(config))
    for path in src.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(path, out / path.name)
    return out


def transformers_dequantized_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers running a 4-bit checkpoint's dequantized weights (engine/quant/evaluate.py)."""
    from engine.quant.evaluate import load_dense_model

    return _generate(load_dense_model(model_dir).eval(), prompts, max_new_tokens)


def top1_agreement(model_a, model_b, sequences: list[list[int]]) -> float:
    """Fraction of teacher-forced positions where the two models' greedy next tokens agree."""
    agree = total = 0
    for ids in sequences:
        a, b = engine_prefill_logits(model_a, ids), engine_prefill_logits(model_b, ids)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
    return agree / total


def test_awq_build_of_qwen3_loads_and_tracks_the_fp_model(checkpoint, tmp_path):
    from engine.quant.quantizer import quantize_model

    src = checkpoint("qwen3")
    calibration = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (4 * 64,), generator=torch.Generator().manual_seed(5)).tolist()
    calibration.write_text(" ".join(f"w{i}" for i in words))
    awq = quantize_model(src, tmp_path / "qwen3-awq", "awq", group_size=32, calibration_path=calibration,
                         num_samples=4, seq_len=64, device="cpu", cpu_threads=1, log=lambda msg: None)
    model = load_cpu(awq)
    layer = model.layers[0]
    qkv = layer.qkv_proj.parts
    assert len(qkv) == 1 and isinstance(qkv[0], PackedInt4) and qkv[0].out_features == (4 + 2 * 2) * 32
    assert isinstance(layer.down_proj.parts[0], PackedInt4) and layer.q_norm.shape == (32,)
    assert model.weight_bytes() < load_cpu(src).weight_bytes()
    # the fused one-row decode layer (GPU) normalizes q and k heads in its qkv epilogue: it takes Qwen3
    assert fused_decode_unsupported(load_model(awq, torch.device("cpu"), torch.float16, Backend(use_triton=False),
                                               64)) is None
    # the loader's wiring: exactly transformers on the same dequantized weights
    prompts = prompts_of((5, 70))
    assert engine_greedy(awq, prompts, 8) == transformers_dequantized_greedy(awq, prompts, 8)
    # quality against the fp model on unseen sequences. A random 64-wide model has flat logits that 4-bit
    # noise reorders often: measured top-1 agreement 0.58-0.62 and relative logit error 0.26-0.36 over three
    # seeds (RTN 0.60-0.64; a same-shape Llama 0.56-0.64), against 1/256 for unrelated models
    fp = load_cpu(src)
    sequences = prompts_of((64, 64, 64), seed=9)
    assert top1_agreement(model, fp, sequences) >= 0.45
    for ids in sequences:
        ours, reference = engine_prefill_logits(model, ids), engine_prefill_logits(fp, ids)
        centred = reference - reference.mean(-1, keepdim=True)
        assert ((ours - reference).norm() / centred.norm()).item() <= 0.5


@pytest.mark.parametrize(("family", "method"), [("phi3", "awq"), ("phi4-mini", "awq"), ("phi4-mini", "gptq")])
def test_quantizer_builds_phi3_fused_projections(checkpoint, tmp_path, family, method):
    """Pagoda's quantizer on Phi-3's fused qkv_proj / gate_up_proj (Phi-4 mini: GQA, so o_proj's scales are
    tied across the query heads of a kv head and folded into the v rows at the end of qkv_proj): the build
    keeps the fused matrices whole, loads, equals transformers on its dequantized weights and tracks the fp
    model as closely as the Qwen3 build does."""
    from engine.quant.quantizer import quantize_model

    src = checkpoint(family)
    calibration = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (4 * 64,), generator=torch.Generator().manual_seed(5)).tolist()
    calibration.write_text(" ".join(f"w{i}" for i in words))
    built = quantize_model(src, tmp_path / f"{family}-{method}", method, group_size=32, calibration_path=calibration,
                           num_samples=4, seq_len=64, device="cpu", cpu_threads=1, log=lambda msg: None)
    model = load_cpu(built)
    layer = model.layers[0]
    for linear in (layer.qkv_proj, layer.gate_up_proj, layer.down_proj):
        assert len(linear.parts) == 1 and isinstance(linear.parts[0], PackedInt4)
    prompts = prompts_of((5, 70))
    assert engine_greedy(built, prompts, 8) == transformers_dequantized_greedy(built, prompts, 8)
    fp = load_cpu(src)
    sequences = prompts_of((64, 64, 64), seed=9)
    agreement = top1_agreement(model, fp, sequences)
    errors = []
    for ids in sequences:
        ours, reference = engine_prefill_logits(model, ids), engine_prefill_logits(fp, ids)
        centred = reference - reference.mean(-1, keepdim=True)
        errors.append(((ours - reference).norm() / centred.norm()).item())
    print(f"{family} {method}: top-1 agreement {agreement:.3f}, relative logit error {max(errors):.3f}")
    assert agreement >= 0.45 and max(errors) <= 0.5


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_4bit_build_of_phi3_with_fused_projections_loads(checkpoint, tmp_path, method):
    quantized = write_rtn_checkpoint(checkpoint("phi4-mini"), tmp_path / f"phi4-mini-{method}", 32, method)
    model = load_cpu(quantized)
    for linear, out_features in ((model.layers[0].qkv_proj, (4 + 2 * 2) * 16),
                                 (model.layers[0].gate_up_proj, 2 * 128)):
        assert len(linear.parts) == 1 and isinstance(linear.parts[0], PackedInt4)
        assert linear.parts[0].out_features == out_features and linear.parts[0].in_features == 64
    prompts = prompts_of((5, 70))
    assert engine_greedy(quantized, prompts, 8) == transformers_dequantized_greedy(quantized, prompts, 8)


# ---- GPU: real layer shapes, Triton kernels, fp16 ----------------------------------------------------------

GPU_SHAPES = {
    # Qwen3-8B's layer: GQA 32/8, head_dim 128 (hidden / heads = 128 too), intermediate 12288; 2 of 36 layers
    "qwen3-8b-2l": ("qwen3", {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 2,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                              "vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 40960}),
    # Phi-3-mini's layer: 32 heads of 96 dims (not a power of two), fused projections
    "phi3-mini-2l": ("phi3", {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 2,
                              "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
                              "max_position_embeddings": 4096, "original_max_position_embeddings": 4096}),
    # Phi-4-mini's layer: GQA 24/8, rotary on 96 of 128 dims, LongRoPE, tied 200k vocabulary
    "phi4-mini-2l": ("phi3", {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 2,
                              "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
                              "tie_word_embeddings": True, "partial_rotary_factor": 0.75,
                              "rope_scaling": longrope(96), "max_position_embeddings": 131072,
                              "original_max_position_embeddings": 4096}),
}


def build_gpu_checkpoint(folder: Path, name: str) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    family, shape = GPU_SHAPES[name]
    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM)}[family]
    torch.manual_seed(0)
    config = config_cls(**shape, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        initializer_range=0.05)
    with torch.device("cuda"):
        model = model_cls(config).to(torch.float16)
    model.save_pretrained(folder, safe_serialization=True)
    write_word_tokenizer(folder, shape["vocab_size"])
    del model
    torch.cuda.empty_cache()
    return folder


@pytest.fixture(scope="module", params=list(GPU_SHAPES))
def gpu_checkpoint(request, tmp_path_factory):
    return build_gpu_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def assert_tracks_transformers_fp16(model_dir: Path, generated: list[list[int]], prompts: list[list[int]],
                                    hf_dir: Path | None = None) -> None:
    """tests/test_gpu_engine.py's judgement: each of our greedy tokens is HF's top pick at that position up to
    fp16 near-ties (teacher forcing on our output), and at least one sequence equals HF's own greedy output."""
    hf_dir = hf_dir or model_dir
    rows = hf_logprobs_along(hf_dir, [p + g for p, g in zip(prompts, generated)])
    for prompt, tokens, logits in zip(prompts, generated, rows):
        for step, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + step]
            top = float(row.max())
            gap = top - float(row[token])
            assert gap <= 0.02 + 2 * fp16_ulp(top), (step, token, int(row.argmax()), gap, top)
    expected = hf_greedy(hf_dir, prompts, 16)
    assert sum(g == e[:len(g)] for g, e in zip(generated, expected)) >= 1


def gpu_generate(model_dir: Path, prompts: list[list[int]], lengths: list[int], **engine_args) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float16", device="cuda", gpu_memory_limit="24GiB", max_num_seqs=32,
              max_num_batched_tokens=512, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["triton-graphs", "triton-eager"])
def test_greedy_matches_transformers_on_gpu(gpu_checkpoint, kernels):
    prompts = random_prompts(gpu_checkpoint)  # 7, 33, 130 and 517 tokens; 517 is chunked by the 512 budget
    lengths = [16, 12, 9, 5]
    generated = gpu_generate(gpu_checkpoint, prompts, lengths, enforce_eager=kernels == "triton-eager")
    assert [len(g) for g in generated] == lengths
    assert_tracks_transformers_fp16(gpu_checkpoint, generated, prompts)


@pytest.mark.gpu
def test_awq_build_matches_dequantized_transformers_on_gpu(gpu_checkpoint, tmp_path):
    """The AWQ loader at real shapes through the W4A16 kernels: judged against transformers running the
    checkpoint's dequantized weights (saved as an fp16 model)."""
    from engine.quant.evaluate import load_dense_model

    awq = write_rtn_checkpoint(gpu_checkpoint, tmp_path / "awq", group_size=128)
    dense_dir = tmp_path / "dequantized"
    load_dense_model(awq, torch.float16).save_pretrained(dense_dir, safe_serialization=True)
    prompts = random_prompts(gpu_checkpoint)
    lengths = [16, 12, 9, 5]
    generated = gpu_generate(awq, prompts, lengths)
    assert [len(g) for g in generated] == lengths
    assert_tracks_transformers_fp16(gpu_checkpoint, generated, prompts, hf_dir=dense_dir)


# ---- catalog builds from a Hub base (models.yaml's phi-4-mini-instruct-awq) --------------------------------

def test_catalog_build_of_a_hub_model_downloads_then_quantizes(checkpoint, tmp_path, monkeypatch):
    """A catalog entry whose base is a Hub model: ``fetch`` downloads the base (from a local fake Hub, through
    huggingface_hub) and quantizes it with Pagoda's quantizer; serving never starts that download itself."""
    from fake_hub import FakeHub

    from engine.catalog import Catalog, builds_from_hub, fetch, resolve_model

    src = checkpoint("phi4-mini")
    files = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    (tmp_path / "models.yaml").write_text(
        "models:\n"
        "  - {id: tiny-phi, name: Tiny Phi, source: hub, repo: org/tiny-phi, quantization: fp32, size_gb: 0.01,"
        " context: 256}\n"
        "  - {id: tiny-phi-awq, name: Tiny Phi AWQ, source: bundled, base: tiny-phi, method: awq, group_size: 32,"
        " quantization: awq, size_gb: 0.01, context: 256}\n")
    catalog = Catalog.load(tmp_path / "models.yaml")
    entry = catalog.get("tiny-phi-awq")
    assert builds_from_hub(entry, catalog)
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path / "home"))
    with FakeHub() as hub:
        hub.add_repo("org/tiny-phi", files)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(EngineError, match="not built yet: run `python app.py fetch tiny-phi-awq`"):
            resolve_model("tiny-phi-awq", catalog)  # even where bundled builds are made on demand
        assert hub.file_stats("org/tiny-phi", "model.safetensors").gets == 0
        built = fetch(entry, catalog, log=lambda msg: None)
    assert json.loads((built / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    assert resolve_model("tiny-phi-awq", catalog)[0] == built
    model = load_cpu(built)
    assert isinstance(model.layers[0].gate_up_proj.parts[0], PackedInt4)
    prompts = prompts_of((5, 30))
    assert engine_greedy(built, prompts, 6) == transformers_dequantized_greedy(built, prompts, 6)


def test_phi4_mini_awq_is_built_on_a_gpu_only():
    """models.yaml's Phi-4 mini AWQ quantizes a 7.7 GB download: on a machine without a GPU it is refused before
    anything is downloaded, with what to do instead."""
    from engine.catalog import Catalog, builds_from_hub, fetch

    catalog = Catalog.load()
    entry = catalog.get("phi-4-mini-instruct-awq")
    assert builds_from_hub(entry, catalog) and entry.group_size == 128 and entry.method == "awq"
    assert not builds_from_hub(catalog.get("smollm2-135m-instruct-awq"), catalog)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the build would start a 7.7 GB download")
    with pytest.raises(EngineError, match="needs a CUDA GPU .*download phi-4-mini-instruct to run it unquantized"):
        fetch(entry, catalog, log=lambda msg: None)
