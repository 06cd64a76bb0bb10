"""Issue 18: Gemma 3 text models (Gemma3ForCausalLM) against HF transformers token by token.

Checkpoints are written by transformers' own Gemma3TextConfig / Gemma3ForCausalLM (random weights, a word-level
tokenizer) and read back by both sides from the same folder. Four layers mix sliding (window 16) and global
attention, so prompts of up to 130 tokens pass the window; query_pre_attn_scalar differs from head_dim; the local
and global rope bases differ (the global one linearly scaled in the 4B+ form); the norm weights are random so
Gemma's (1 + weight) scaling counts. On CPU in float32 the engine's prefill logits must equal transformers'
bit for bit (the same ops in the same order) and its greedy tokens must equal ``generate``'s. What the engine
cannot run exactly is refused with an EngineError that says why. The GPU variant runs Gemma-3-1B's layer shape
in bf16 with the Triton kernels, judged like tests/test_gpu_engine.py with bf16's rounding.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_gpu_engine import random_prompts, write_word_tokenizer
from test_model_families import (
    COMMON,
    VOCAB,
    engine_greedy,
    engine_prefill_logits,
    load_cpu,
    prompts_of,
    transformers_dequantized_greedy,
    transformers_greedy,
    write_rtn_checkpoint,
)

from engine import LLM, SamplingParams
from engine.config import ModelConfig, resolve_dtype
from engine.errors import EngineError
from engine.layers.linear import PackedInt4
from engine.layers.rotary import cos_sin_cache
from engine.model_loader import load_model
from engine.models.fused_decode import fused_decode_unsupported
from engine.models.gemma3 import Gemma3Model
from kernels.ops import Backend

MIXED = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512, "sliding_window": 16,
               "layer_types": MIXED, "query_pre_attn_scalar": 24, "initializer_range": 0.02}
VARIANTS = {
    "gemma3-1b-form": {},  # global rope 1e6, local 1e4, no scaling, no soft-capping (Gemma 3 1B's form)
    "gemma3-4b-form": {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 5000.0},
    "softcapped": {"final_logit_softcapping": 0.5},  # Gemma 2's final soft-capping, small enough to bend logits
}


def build_gemma3(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random Gemma 3 checkpoint. Norm weights start at zero (scale 1): each gets noise, and the norms before
    the residual adds one more, so the layers rather than the tied embedding pick the next token (with the tied
    head the current token's own row dominates otherwise, and greedy output repeats one token)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**COMMON, **GEMMA3_TINY, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param) + (1.0 if ".post_" in name else 0.0))
    model.save_pretrained(folder, safe_serialization=True)
    write_word_tokenizer(folder, VOCAB)
    return folder


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """name -> folder of VARIANTS, built once per module on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_gemma3(tmp_path_factory.mktemp(name), **VARIANTS[name])
        return built[name]

    return get


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_equal_transformers(gemma3, variant):
    folder = gemma3(variant)
    ids = prompts_of((130,), seed=2)[0]
    ours = engine_prefill_logits(load_cpu(folder), ids)  # [130, vocab]
    with torch.no_grad():
        theirs = hf_model(folder)(torch.tensor([ids])).logits[0]
    assert torch.equal(ours, theirs)
    assert theirs.std().item() > 0.1  # logits that differ between tokens: the comparison can fail
    if VARIANTS[variant].get("final_logit_softcapping"):
        cap = VARIANTS[variant]["final_logit_softcapping"]
        assert cap * 0.6 < theirs.abs().max().item() <= cap  # the cap bends them


@pytest.mark.parametrize("variant", ["gemma3-1b-form", "gemma3-4b-form"])  # soft-capping keeps the argmax
def test_greedy_matches_transformers(gemma3, variant):
    """Prefill (chunked by the 64-token step budget), decode and their mixes, past the 16-token window."""
    folder = gemma3(variant)
    prompts = prompts_of((5, 40, 70, 130))
    ours = engine_greedy(folder, prompts, 16)
    assert ours == transformers_greedy(folder, prompts, 16)
    assert min(len(set(tokens)) for tokens in ours) >= 3  # not one repeated token: the comparison can fail


def test_windows_and_local_rope_change_the_logits(gemma3, tmp_path):
    """The test above would pass vacuously if windows or the local rope did nothing: each changes the logits."""
    folder = gemma3("gemma3-1b-form")
    ids = prompts_of((130,), seed=2)[0]
    reference = engine_prefill_logits(load_cpu(folder), ids)
    config = json.loads((folder / "config.json").read_text())
    for name, change in (("no-window", {"sliding_window": 4096}),
                         ("one-rope", {"rope_parameters": {kind: config["rope_parameters"]["full_attention"]
                                                           for kind in ("full_attention", "sliding_attention")}})):
        other = tmp_path / name
        other.mkdir()
        (other / "config.json").write_text(json.dumps({**config, **change}))
        (other / "model.safetensors").symlink_to(folder / "model.safetensors")
        assert (engine_prefill_logits(load_cpu(other), ids) - reference).abs().max().item() > 1e-2, name


def test_config_and_layers_are_read_as_transformers_reads_them(gemma3):
    folder = gemma3("gemma3-4b-form")
    hf = hf_model(folder)
    model = load_cpu(folder)
    cfg = model.config
    assert isinstance(model, Gemma3Model) and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.layer_windows == (16, 16, 0, 16) and [cfg.uses_local_rope(i) for i in range(4)] == [1, 1, 0, 1]
    assert cfg.attention_scale == hf.model.layers[0].self_attn.scaling == 24 ** -0.5
    assert model.lm_head is model.embed_tokens
    layer = model.layers[0]
    assert layer.pre_feedforward_layernorm.dtype == torch.float32
    assert torch.equal(layer.q_norm, 1.0 + hf.model.layers[0].self_attn.q_norm.weight)
    # the two rope tables are transformers' own (cos of the half-dim frequencies, then sin)
    rotary = hf.model.rotary_emb
    positions = torch.arange(256)[None]
    for kind, theta, scaling in (("full_attention", cfg.rope_theta, cfg.rope_scaling),
                                 ("sliding_attention", cfg.local_rope_theta, None)):
        cos, sin = rotary(torch.zeros(1), positions, kind)  # [1, 256, head_dim]
        table = cos_sin_cache(cfg.head_dim, 256, theta, scaling, torch.device("cpu"))
        torch.testing.assert_close(table, torch.cat([cos[0, :, :16], sin[0, :, :16]], -1), rtol=0, atol=2e-7)
    assert torch.equal(model.rope_table(2), model.cos_sin_cache) and torch.equal(model.rope_table(0),
                                                                                 model.local_cos_sin_cache)


def test_hub_config_is_read_as_gemma3_text_config_reads_it():
    """gemma-3-4b-it's text_config in transformers 4's form (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern, no layer_types), as a Gemma3ForCausalLM."""
    from transformers import Gemma3TextConfig

    hub = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 2560,
           "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 256, "vocab_size": 262208, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
           "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
           "torch_dtype": "bfloat16", "final_logit_softcapping": None, "attn_logit_softcapping": None}
    cfg = ModelConfig.from_dict(hub)
    theirs = Gemma3TextConfig(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")})
    full, sliding = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert cfg.rope_theta == full["rope_theta"] and cfg.rope_scaling["factor"] == full["factor"] == 8.0
    assert cfg.local_rope_theta == sliding["rope_theta"] == 10000.0 and sliding["rope_type"] == "default"
    assert [cfg.window_of(i) > 0 for i in range(34)] == [t == "sliding_attention" for t in theirs.layer_types]
    assert cfg.window_of(5) == 0 and cfg.window_of(0) == 1024
    assert cfg.tie_word_embeddings and cfg.attention_scale == 256 ** -0.5 and cfg.final_logit_softcapping is None


@pytest.mark.parametrize("fields, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 .*not in Pagoda's attention kernels"),
    ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"attention_bias": True}, "attention_bias true"),
    ({"sliding_window": None}, "sliding_attention layers but sets no sliding_window"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer type.*chunked_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope on the sliding layers: type 'linear'"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "unsupported architecture"),
])
def test_configs_pagoda_cannot_run_exactly_are_refused(fields, message):
    base = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": VOCAB, **GEMMA3_TINY}
    with pytest.raises(EngineError, match=message):
        ModelConfig.from_dict({**base, **fields})


def test_attention_softcapping_checkpoint_is_refused_before_loading(gemma3, tmp_path):
    """Through the engine as a user loads it: a clear EngineError, not a model that runs wrong."""
    folder = tmp_path / "capped"
    folder.mkdir()
    config = json.loads((gemma3("gemma3-1b-form") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0}))
    with pytest.raises(EngineError, match="attn_logit_softcapping"):
        LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="16MiB")


@pytest.mark.parametrize("stored", ["float16", "float32", "bfloat16", None])
def test_auto_dtype_is_bf16_on_gpu(stored):
    """fp16 overflows Gemma's activations: 'auto' picks bf16 on a GPU whatever the checkpoint says; CPU stays fp32."""
    cfg = ModelConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], "vocab_size": VOCAB, **GEMMA3_TINY,
                                 "torch_dtype": stored})
    assert resolve_dtype("auto", torch.device("cuda"), cfg.torch_dtype) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu"), cfg.torch_dtype) == torch.float32
    assert resolve_dtype("float16", torch.device("cuda"), cfg.torch_dtype) == torch.float16  # asked for: given


def test_awq_build_loads_and_matches_dequantized_transformers(gemma3, tmp_path):
    """An AutoAWQ-GEMM-layout build (plain rounding, every decoder linear packed). The fused one-row decode layer
    implements Llama's layer only and must not take it."""
    awq = write_rtn_checkpoint(gemma3("gemma3-1b-form"), tmp_path / "gemma3-awq", 32)
    model = load_cpu(awq)
    for linear in (model.layers[0].qkv_proj, model.layers[3].down_proj):
        assert all(isinstance(part, PackedInt4) for part in linear.parts)
    assert "Gemma 3" in fused_decode_unsupported(load_model(awq, torch.device("cpu"), torch.float16,
                                                            Backend(use_triton=False), 64))
    prompts = prompts_of((5, 70, 130))
    assert engine_greedy(awq, prompts, 8) == transformers_dequantized_greedy(awq, prompts, 8)


def _calibration_text(tmp_path: Path) -> Path:
    words = torch.randint(3, VOCAB, (4 * 64,), generator=torch.Generator().manual_seed(5)).tolist()
    path = tmp_path / "calibration.txt"
    path.write_text(" ".join(f"w{i}" for i in words))
    return path


def _tracking(model, fp, sequences: list[list[int]]) -> tuple[float, float]:
    """(top-1 agreement with the fp model, worst relative logit error) over teacher-forced ``sequences``."""
    from test_model_families import top1_agreement

    errors = []
    for ids in sequences:
        ours, reference = engine_prefill_logits(model, ids), engine_prefill_logits(fp, ids)
        centred = reference - reference.mean(-1, keepdim=True)
        errors.append(((ours - reference).norm() / centred.norm()).item())
    return top1_agreement(model, fp, sequences), max(errors)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantizer_builds_gemma3(gemma3, tmp_path, method):
    """Pagoda's quantizer on Gemma 3: AWQ folds its scales into norms that scale by 1 + w (the MLP's is
    pre_feedforward_layernorm), and each layer is calibrated with its own rotary table and mask. The build
    equals transformers on its dequantized weights, and on the calibration text (what AWQ and GPTQ minimise
    the error on) it tracks the fp model better than plain rounding. Measured on this tiny random model: RTN
    agreement 0.48 / logit error 0.39, AWQ 0.64 / 0.26, GPTQ 0.84 / 0.15; AWQ with the scales folded as w / s
    (Llama's norms) 0.29 / 0.69 on unseen text, where RTN gives 0.58 / 0.36."""
    from transformers import AutoTokenizer

    from engine.quant.quantizer import quantize_model

    src, calibration = gemma3("gemma3-1b-form"), _calibration_text(tmp_path)
    options = {"group_size": 32, "device": "cpu", "cpu_threads": 1, "log": lambda msg: None}
    built = quantize_model(src, tmp_path / f"gemma3-{method}", method, calibration_path=calibration,
                           num_samples=4, seq_len=64, **options)
    rtn = quantize_model(src, tmp_path / "gemma3-rtn", "rtn", **options)
    model = load_cpu(built)
    assert all(isinstance(part, PackedInt4) for part in model.layers[0].qkv_proj.parts)
    prompts = prompts_of((5, 70))
    assert engine_greedy(built, prompts, 8) == transformers_dequantized_greedy(built, prompts, 8)
    ids = AutoTokenizer.from_pretrained(src)(calibration.read_text(), add_special_tokens=False).input_ids
    windows = [ids[i * 64:(i + 1) * 64] for i in range(4)]
    fp = load_cpu(src)
    (agreement, error), (rtn_agreement, rtn_error) = _tracking(model, fp, windows), _tracking(load_cpu(rtn), fp,
                                                                                              windows)
    assert agreement > rtn_agreement + 0.1 and error < rtn_error - 0.1, (agreement, error, rtn_agreement, rtn_error)


def test_quantizer_gives_each_layer_its_own_rotary_table_and_mask(gemma3):
    """Sliding layers get the local rope base and the windowed mask, global layers their own: what the model
    itself passes each layer, captured without running the layers."""
    from transformers import AutoModelForCausalLM

    from engine.quant.quantizer import _decoder_layers, _layer_inputs

    model = AutoModelForCausalLM.from_pretrained(gemma3("gemma3-1b-form"), dtype=torch.float64).eval()
    layers, _ = _decoder_layers(model)
    ids = torch.tensor(prompts_of((40, 40)))
    hidden, kwargs = _layer_inputs(model, layers, ids, torch.device("cpu"))
    assert hidden.shape == (2, 40, GEMMA3_TINY["hidden_size"]) and len(kwargs) == len(MIXED)
    cos = [k["position_embeddings"][0] for k in kwargs]
    assert torch.equal(cos[0], cos[1]) and torch.equal(cos[0], cos[3]) and not torch.equal(cos[0], cos[2])
    expected = []
    handles = [layer.register_forward_pre_hook(lambda m, a, k: expected.append(k), with_kwargs=True)
               for layer in layers]
    model.model(input_ids=ids, use_cache=False)
    for handle in handles:
        handle.remove()
    for got, want in zip(kwargs, expected):
        assert torch.equal(got["position_embeddings"][0], want["position_embeddings"][0])
        if torch.is_tensor(want.get("attention_mask")):
            assert torch.equal(got["attention_mask"], want["attention_mask"])
    assert all(layer.forward.__func__ is type(layer).forward for layer in layers)  # the stubs are gone


def test_fit_estimate_counts_what_the_loader_holds(gemma3):
    """engine/fit.py's weight estimate includes Gemma's extra norms, held in float32."""
    from engine.fit import estimate_weight_bytes

    model = load_model(gemma3("gemma3-1b-form"), torch.device("cpu"), torch.bfloat16, Backend(use_triton=False), 64)
    assert estimate_weight_bytes(model.config, torch.bfloat16) == model.weight_bytes()


# ---- GPU: Gemma-3-1B's layer shape, Triton kernels, bf16 ---------------------------------------------------

GEMMA3_1B_2L = {"hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "vocab_size": 262144,
                "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"],
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}


def bf16_ulp(value: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(value), 2.0 ** -126))) - 7)


def build_gemma3_gpu(folder: Path) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(**GEMMA3_1B_2L, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.05)
    with torch.device("cuda"):
        model = Gemma3ForCausalLM(config).to(torch.bfloat16)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    write_word_tokenizer(folder, GEMMA3_1B_2L["vocab_size"])
    del model
    torch.cuda.empty_cache()
    return folder


def hf_bf16(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).cuda().eval()


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["triton-graphs", "triton-eager"])
def test_greedy_tracks_transformers_on_gpu_bf16(tmp_path, kernels):
    """tests/test_gpu_engine.py's judgement in bf16: each greedy token is HF's top pick at that position up to
    bf16 near-ties (teacher forcing on our output), and at least one sequence equals HF's own greedy output.
    Prompts of 7-517 tokens cross the 512-token window; 'auto' picks bf16."""
    folder = build_gemma3_gpu(tmp_path / "gemma3-1b-2l")
    prompts, lengths = random_prompts(folder), [16, 12, 9, 5]
    llm = LLM(str(folder), dtype="auto", device="cuda", gpu_memory_limit="24GiB", max_num_seqs=32,
              max_num_batched_tokens=512, enforce_eager=kernels == "triton-eager")
    assert llm.engine.dtype == torch.bfloat16
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    generated = [o.outputs[0].token_ids for o in outs]
    del llm
    torch.cuda.empty_cache()
    assert [len(g) for g in generated] == lengths
    hf = hf_bf16(folder)
    with torch.no_grad():
        for prompt, tokens in zip(prompts, generated):
            logits = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0].float().cpu()
            for step, token in enumerate(tokens):
                row = logits[len(prompt) - 1 + step]
                top = float(row.max())
                gap = top - float(row[token])
                assert gap <= 0.02 + 2 * bf16_ulp(top), (step, token, int(row.argmax()), gap, top)
        same = 0
        for prompt, tokens in zip(prompts, generated):
            x = torch.tensor([prompt], device="cuda")
            expected = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                   max_new_tokens=len(tokens), min_new_tokens=len(tokens), pad_token_id=0)
            same += expected[0, len(prompt):].tolist() == tokens
    assert same >= 1


def test_catalog_has_a_4bit_gemma3_built_here():
    from engine.catalog import Catalog, builds_from_hub

    catalog = Catalog.load()
    entry = catalog.get("gemma-3-1b-it-awq")
    assert builds_from_hub(entry, catalog) and entry.method == "awq" and entry.group_size == 128
    # the group size divides every linear input of Gemma 3 1B (hidden 1152, 4 x 256 query dims, MLP 6912)
    assert all(size % entry.group_size == 0 for size in (1152, 1024, 6912))

