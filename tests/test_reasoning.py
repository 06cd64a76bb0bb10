"""Reasoning content: a random-weight Llama with a word tokenizer whose chat template forces ``<think>``, served
by `app.py serve`; a logit bias on ``</think>`` makes the block end within a few tokens. (llguidance cannot read
a WordPiece decoder, so grammars are refused with a 400 on this model; grammars after reasoning are not tested
here.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from server_process import launch_server

from engine.reasoning import split_reasoning

VOCAB = 64
THINK, END_THINK = VOCAB - 2, VOCAB - 1
TEMPLATE = ("{% for m in messages %}{{ m['content'].split('</think>')[-1] }} {% endfor %}"
            "{% if add_generation_prompt %}<think> {% endif %}")


def build_thinking_model(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<think>": THINK, "</think>": END_THINK}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", bos_token="w1", unk_token="w0")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    folder = build_thinking_model(tmp_path_factory.mktemp("thinking"))
    with launch_server(folder, "--kv-cache-memory", "16MiB", ui=False) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_split_reasoning_of_whole_outputs():
    assert split_reasoning("<think>plan</think>\n\nanswer", False) == ("plan", "answer")
    assert split_reasoning("plan</think>answer", True) == ("plan", "answer")
    assert split_reasoning("no thinking", False) == (None, "no thinking")
    assert split_reasoning("cut short", True) == ("cut short", "")


ASK = [{"role": "user", "content": "w5 w6 w7"}]
BIAS = {str(END_THINK): 3.0}  # about one token in four closes the block


def test_reasoning_is_split_plain_and_streamed(client):
    kwargs = {"model": "", "messages": ASK, "max_tokens": 24, "temperature": 1.0, "seed": 11, "logit_bias": BIAS}
    message = client.chat.completions.create(**kwargs).choices[0].message
    raw = client.completions.create(model="", prompt=ASK[0]["content"] + " <think>", max_tokens=24,
                                    temperature=1.0, seed=11, logit_bias=BIAS).choices[0].text
    assert "</think>" in raw  # the block ends within max_tokens (24 tries at about 1/4)
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning is not None and "think>" not in reasoning  # later </think> tokens are content (random model)
    assert raw.startswith(reasoning) and (message.content or "").strip() in raw
    assert message.model_extra["reasoning"] == reasoning
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed_reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed_reasoning == reasoning and streamed_content == (message.content or "")

