"""Fit estimator: weight / KV / block arithmetic against hand counts and published parameter counts."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import ModelConfig
from engine.errors import EngineError
from engine.fit import GiB, MiB, check_fit, estimate_weight_bytes, kv_bytes_per_token, require_fit

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "tie_word_embeddings": True, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
}
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False,
    "max_position_embeddings": 4096, "torch_dtype": "float16",
}
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}


def config(base: dict, **extra) -> ModelConfig:
    return ModelConfig.from_dict({**base, **extra})


def test_smollm2_weights_and_kv_match_a_hand_count():
    mc = config(SMOLLM2_135M)
    embed = 49152 * 576  # tied: no separate lm_head
    attn = 576 * 576 + 2 * 576 * (3 * 64) + 576 * 576  # q, k, v (3 kv heads of 64), o
    mlp = 3 * 576 * 1536
    params = embed + 30 * (attn + mlp + 2 * 576) + 576
    assert params == 134_515_008  # SmolLM2-135M's published parameter count
    assert estimate_weight_bytes(mc, torch.float16) == 2 * params
    assert estimate_weight_bytes(mc, "float32") == 4 * params
    assert estimate_weight_bytes(mc, "auto") == 2 * params  # bf16 checkpoint stays 2 bytes on a GPU
    assert kv_bytes_per_token(mc, torch.float16) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(mc, torch.float32) == 46_080


def test_7b_fp16_weights_match_published_parameter_counts():
    assert estimate_weight_bytes(config(LLAMA2_7B), torch.float16) == 2 * 6_738_415_616
    assert kv_bytes_per_token(config(LLAMA2_7B), torch.float16) == 2 * 32 * 32 * 128 * 2  # 512 KiB
    # Qwen2 adds q/k/v biases (no o_proj bias), GQA 28/4 heads, an untied 152k vocabulary
    assert estimate_weight_bytes(config(QWEN2_7B), torch.bfloat16) == 2 * 7_615_616_512


def awq_runtime_bytes(base: dict, group: int, desc_act: bool = False) -> int:
    """Bytes of the kernel contract's PackedInt4 tensors, enumerated tensor by tensor from their shapes."""
    h, inter, n_layers = base["hidden_size"], base["intermediate_size"], base["num_hidden_layers"]
    head_dim = h // base["num_attention_heads"]
    q, kv = base["num_attention_heads"] * head_dim, base["num_key_value_heads"] * head_dim
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    tensors = []
    for k, n in linears:
        tensors += [torch.empty(k // 8, n, dtype=torch.int32, device="meta"),  # qweight
                    torch.empty(k // group, n, dtype=torch.float16, device="meta"),  # scales
                    torch.empty(k // group, n, dtype=torch.float16, device="meta")]  # zeros
    if desc_act:  # one int64 permutation per merged input: qkv, o, gate_up, down
        tensors += [torch.empty(k, dtype=torch.int64, device="meta") for k in (h, q, h, inter)]
    per_layer = sum(t.numel() * t.element_size() for t in tensors) + 2 * h * 2  # + two fp16 norms
    embed_and_head = 2 * base["vocab_size"] * h * 2
    return n_layers * per_layer + embed_and_head + h * 2


def test_awq_and_gptq_weights_follow_the_packed_int4_layout():
    awq_7b = estimate_weight_bytes(config(LLAMA2_7B, quantization_config=AWQ), torch.float16)
    assert awq_7b == awq_runtime_bytes(LLAMA2_7B, group=128)
    assert 3.8e9 < awq_7b < 4.1e9  # TheBloke/Llama-2-7B-AWQ: 3.89 GB on disk (int4 zeros; fp16 here)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True}
    gptq_7b = estimate_weight_bytes(config(LLAMA2_7B, quantization_config=gptq), torch.float16)
    assert gptq_7b == awq_runtime_bytes(LLAMA2_7B, group=64, desc_act=True)
    assert kv_bytes_per_token(config(LLAMA2_7B, quantization_config=AWQ), torch.float16) == 524_288


def test_kv_blocks_context_and_concurrency_are_whole_blocks_of_the_leftover():
    mc = config(LLAMA2_7B)
    budget, reserve = 16 * GiB, 300 * MiB
    report = check_fit(mc, torch.float16, budget, max_model_len=4000, activation_reserve_bytes=reserve)
    left = budget - 2 * 6_738_415_616 - reserve
    blocks = left // (16 * 524_288)
    assert report.kv_budget_bytes == left and report.num_blocks == blocks
    assert report.max_context_tokens == 16 * blocks
    assert report.max_concurrency == blocks // 250  # 4000 tokens = 250 blocks
    assert report.fits and report.suggested_max_model_len is None
    assert report.kv_cache_bytes == blocks * 16 * 524_288 <= left
    assert "fits" in report.message and f"{16 * blocks:,} tokens" in report.message


def test_explicit_kv_budget_is_used_as_is():
    mc = config(SMOLLM2_135M)
    report = check_fit(mc, torch.float32, 8 * GiB, max_model_len=2048, kv_cache_bytes=256 * MiB)
    assert report.num_blocks == 256 * MiB // (16 * 46_080)
    assert report.max_concurrency == report.num_blocks // 128


def test_refusal_names_the_numbers_and_a_max_model_len_that_fits():
    mc = config(LLAMA2_7B)
    budget, reserve = 14 * GiB, 256 * MiB
    with pytest.raises(EngineError) as err:
        require_fit(mc, "float16", budget, max_model_len=4096, activation_reserve_bytes=reserve)
    assert err.value.param == "max_model_len"
    blocks = (budget - 2 * 6_738_415_616 - reserve) // (16 * 524_288)
    suggested = 16 * blocks
    message = err.value.message
    assert f"--max-model-len {suggested}" in message
    assert "12.55 GiB" in message and "14.00 GiB" in message and "2.00 GiB of KV cache" in message

    assert require_fit(mc, "float16", budget, suggested, activation_reserve_bytes=reserve).max_concurrency == 1
    assert not check_fit(mc, "float16", budget, suggested + 1, activation_reserve_bytes=reserve).fits


def test_weights_larger_than_the_budget_suggest_a_4bit_model():
    mc = config(LLAMA2_7B)
    report = check_fit(mc, torch.float16, 10 * GiB, max_model_len=4096)
    assert not report.fits and report.num_blocks == 0 and report.suggested_max_model_len is None
    assert "4-bit" in report.message
    quantized = check_fit(config(LLAMA2_7B, quantization_config=AWQ), torch.float16, 10 * GiB, max_model_len=4096)
    assert quantized.fits and quantized.max_concurrency >= 1


def test_default_max_model_len_is_the_models_context():
    report = check_fit(config(SMOLLM2_135M), torch.float16, 4 * GiB)
    assert report.max_model_len == 8192 and report.max_concurrency == report.num_blocks // 512


@pytest.fixture()
def checkpoint_dir(request):
    pytest.importorskip("engine.bundled")  # the default model is materialised by engine/bundled.py
    return request.getfixturevalue("default_model_dir")


def test_estimate_matches_the_default_model_checkpoint(checkpoint_dir):
    """Dense checkpoint: the estimate is exactly the bytes of the tensors stored in its safetensors."""
    from safetensors import safe_open

    mc = ModelConfig.from_path(checkpoint_dir)
    sizes = {"F16": 2, "BF16": 2, "F32": 4}
    stored, dtypes = 0, set()
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = f.get_slice(name)
                dtypes.add(tensor.get_dtype())
                stored += math.prod(tensor.get_shape()) * sizes[tensor.get_dtype()]
    (dtype,) = dtypes
    torch_dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[dtype]
    assert estimate_weight_bytes(mc, torch_dtype) == stored


def test_the_int8_head_is_a_byte_a_weight_and_a_scale_a_row():
    # --lm-head-quantization int8: an untied head goes from 2 bytes a weight to 1 (+ a 2-byte scale a row); a
    # tied one adds those bytes, since the embedding stays for the lookups
    awq_7b = config(LLAMA2_7B, quantization_config=AWQ)
    head_fp16, head_int8 = 32000 * 4096 * 2, 32000 * (4096 + 2)
    assert (estimate_weight_bytes(awq_7b, torch.float16) - estimate_weight_bytes(awq_7b, torch.float16, "int8")
            == head_fp16 - head_int8)
    smol = config(SMOLLM2_135M)
    assert (estimate_weight_bytes(smol, torch.float16, "int8") - estimate_weight_bytes(smol, torch.float16)
            == 49152 * (576 + 2))
    assert (check_fit(awq_7b, torch.float16, 8 * GiB, lm_head_quantization="int8").weight_bytes
            == estimate_weight_bytes(awq_7b, torch.float16, "int8"))
