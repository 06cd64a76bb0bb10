"""``--lm-head-quantization int8``: the LM head held as int8 rows with a scale each (engine/layers/linear.py).

What a user sees: the flag on the command line, a model that loads and serves with it, logits that track the
checkpoint's head on real text (the head is the only weight that changes), and a clear error for a value the
engine does not know. The kernels' own cases (the dense GEMV's int8 rows, the W8A16 matmul) are in
tests/kernel_cases.py; the fused decode step's wiring in tests/test_fused_decode.py.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.errors import EngineError
from engine.forward_batch import ForwardBatch
from engine.layers.linear import Int8Rows
from engine.model_loader import load_model
from kernels.ops import Backend

BLOCK = 16


def test_the_flag_reaches_the_engine_args():
    from app import add_engine_flags, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_args_from(parser.parse_args([])).lm_head_quantization == "none"
    assert engine_args_from(parser.parse_args(["--lm-head-quantization", "int8"])).lm_head_quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--lm-head-quantization", "int4"])


def test_an_unknown_head_quantization_is_refused(default_model_dir):
    with pytest.raises(EngineError, match="unknown lm_head quantization 'int4'") as error:
        load_model(default_model_dir, torch.device("cpu"), torch.float32, Backend(use_triton=False),
                   max_positions=64, lm_head_quantization="int4")
    assert error.value.param == "lm_head_quantization"


def _all_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill of ``ids`` (every position sampled)."""
    cfg = model.config
    blocks = -(-len(ids) // BLOCK)
    shape = (blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    model.bind_kv_caches([(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers])
    n = len(ids)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32), logits_indices=torch.arange(n), is_decode=False)
    return model.forward(batch)


def test_the_int8_head_tracks_the_checkpoints_on_heldout_text(default_model_dir, heldout_ids):
    # the default model (tied embedding): its head as int8 rows against the fp16 one over 256 held-out tokens.
    # Measured on this model (session 32): top-1 agreement 0.96, KL 0.002 nat a token over 2,048 tokens of the
    # README; a 6-bit head of 16-weight blocks (like llama.cpp's Q6_K) agreed on 0.94 there
    ids = heldout_ids[:256].tolist()
    backend = Backend(use_triton=False)
    dense = load_model(default_model_dir, torch.device("cpu"), torch.float32, backend, max_positions=512)
    int8 = load_model(default_model_dir, torch.device("cpu"), torch.float32, backend, max_positions=512,
                      lm_head_quantization="int8")
    assert isinstance(int8.lm_head, Int8Rows) and not isinstance(dense.lm_head, Int8Rows)
    assert torch.equal(int8.embed_tokens, dense.embed_tokens)  # the tied embedding is kept for the lookups
    head = dense.lm_head
    assert int8.weight_bytes() - dense.weight_bytes() == head.shape[0] * (head.shape[1] + head.element_size())
    want, got = _all_logits(dense, ids), _all_logits(int8, ids)
    top1 = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    log_want, log_got = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = (log_want.exp() * (log_want - log_got)).sum(-1).mean().item()
    assert top1 >= 0.9 and kl <= 0.01, (top1, kl)


def test_a_model_serves_with_the_int8_head(default_model_dir):
    from engine import LLM, SamplingParams

    llm = LLM(str(default_model_dir), dtype="float32", device="cpu", kv_cache_memory="16MiB",
              lm_head_quantization="int8")
    assert isinstance(llm.engine.runner.model.lm_head, Int8Rows)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8 and out[0].outputs[0].text.strip()


def test_a_gptq_checkpoint_with_a_packed_head_loads_and_decodes(tmp_path):
    # GPTQModel's lm_head=True (vLLM loads these): the head is a packed int4 Linear, the fit check counts it, the
    # fused step's head launch (the int4 GEMV with the final norm) agrees with the unfused step's W4A16 matmul, and
    # --lm-head-quantization int8 is refused on it by name
    from test_fused_decode import _compare
    from test_model_families import build_checkpoint, write_rtn_checkpoint

    from engine.config import ModelConfig
    from engine.fit import estimate_weight_bytes
    from engine.layers.linear import Linear, PackedInt4
    from engine.model_loader import read_config_dict

    dense = build_checkpoint(tmp_path / "llama", "llama")
    gptq = write_rtn_checkpoint(dense, tmp_path / "gptq", group_size=32, method="gptq", quantize_head=True)
    backend = Backend(use_triton=False)
    model = load_model(gptq, torch.device("cpu"), torch.float16, backend, max_positions=64)
    assert isinstance(model.lm_head, Linear) and isinstance(model.lm_head.parts[0], PackedInt4)
    config = ModelConfig.from_dict(read_config_dict(gptq))
    assert model.weight_bytes() == estimate_weight_bytes(config, torch.float16)
    reference = load_model(dense, torch.device("cpu"), torch.float32, backend, max_positions=64)
    hidden = torch.randn(3, config.hidden_size)
    packed = model.lm_head.parts[0]
    want = reference.lm_head @ hidden.t()  # the head's own rounding error is bounded by its group's step
    got = torch.nn.functional.linear(hidden.half(), model.lm_head._dense_for_cpu(0, packed, torch.float16)).float()
    assert ((got - want.t()).norm() / want.norm()).item() < 0.2
    _compare(gptq, "cpu", torch.float32, backend, atol=2e-3, steps=3)
    with pytest.raises(EngineError, match="already packed int4") as error:
        load_model(gptq, torch.device("cpu"), torch.float32, backend, max_positions=64, lm_head_quantization="int8")
    assert error.value.param == "lm_head_quantization"
