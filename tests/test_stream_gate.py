"""The stream gate (engine/stream_gate.py) on a GPU: work queued behind a ticket waits for the host, and a
constrained batch sampled behind the gate on the grammar process's done word is the batch sampled after its
masks were ready."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from engine.stream_gate import StreamGate

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {  # bounded, so random weights end most outputs within max_tokens
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
CORPUS = ['{"name": "Ada", "age": 36, "tags": ["math", "engines"]}', "the quick brown fox jumps over the lazy dog",
          '{"a": [1, 2, 3], "b": {"c": "d"}, "e": true, "f": null}', "0123456789 ,.:;{}[]\"'"]


def test_work_behind_a_ticket_waits_until_the_host_opens_it():
    device = torch.device("cuda")
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # [1], the ticket word
    gate = StreamGate.for_device(device, word.numpy())
    assert gate is not None, "this GPU and driver should support stream memory operations"
    host = torch.zeros(1 << 16, dtype=torch.int32, pin_memory=True)  # [65536]
    gate.hold(1)
    on_device = host.to(device, non_blocking=True)  # queued behind the wait: reads the host buffer when it runs
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    assert not done.query(), "the copy ran before the gate opened"
    host.fill_(7)  # written after the copy was queued
    word[0] = 1  # open ticket 1
    done.synchronize()
    assert bool((on_device == 7).all())


def write_bpe_model(folder: Path, vocab_size: int = 1024) -> Path:
    """A random 2-layer Llama with a byte-level BPE tokenizer trained here (llguidance needs every token's
    bytes, which a word-level tokenizer does not give)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(fast), max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.05)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(folder, safe_serialization=True)
    return folder


def test_constrained_batch_behind_the_gate_equals_sampling_after_the_masks(tmp_path, monkeypatch):
    from engine import LLM, SamplingParams
    from engine.structured_output import StructuredOutputsParams

    llm = LLM(str(write_bpe_model(tmp_path)), max_model_len=512)
    runner = llm.engine.runner
    held = []
    hold = StreamGate.hold
    monkeypatch.setattr(StreamGate, "hold", lambda self, ticket: held.append(ticket) or hold(self, ticket))
    prompts = [{"prompt_token_ids": [5 + i, 40 + i, 7]} for i in range(16)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=128,
                             structured_outputs=StructuredOutputsParams.from_schema(SCHEMA))
              for i in range(len(prompts))]

    def run() -> list:
        return [o.outputs[0] for o in llm.generate(prompts, params)]

    gated = run()
    assert runner._mask_gate is not None and held, "the constrained batch did not go through the gate"
    runner._mask_gate = None  # the masks are now waited for on the host before the sampling is queued
    held.clear()
    ungated = run()
    assert not held
    assert [o.token_ids for o in gated] == [o.token_ids for o in ungated]
    finished = [o.text for o in gated if o.finish_reason == "stop"]
    assert finished, "no output ended on its own"
    for text in finished:
        assert set(json.loads(text)) == {"name", "age", "tags"}
