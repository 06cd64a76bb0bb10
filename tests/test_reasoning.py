"""Reasoning content: a random-weight Llama with a word tokenizer whose chat template forces ``<think>``, served
by `app.py serve`; a logit bias on ``</think>`` makes the block end within a few tokens. (llguidance cannot read
a WordPiece decoder, so grammars are refused with a 400 on this model.)

Grammars after reasoning run on a second model with the default model's real SmolLM2 BPE tokenizer (where
``</think>`` is three tokens) and a template that forces ``<think>``: its one layer adds nothing to the
residual stream, so each next token depends on the current one alone, and its embeddings and output rows are
set so that it writes a fixed sentence and then ``</think>``; what follows is left to random rows and the
grammar. The sentence coming out whole shows that the grammar left the reasoning free."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field
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



# ---- grammars start after </think>, on the real BPE tokenizer ---------------------------------------------------
BPE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].split('</think>')[-1] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
THOUGHT = "I should write a person."  # what the model is built to think; not JSON, so a grammar would forbid it


class Tag(BaseModel):
    model_config = ConfigDict(extra="forbid")  # closed objects: a grammar that ends
    label: str = Field(max_length=8)
    weight: Literal[1, 2, 3]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    role: Literal["admin", "user"]
    tags: list[Tag] = Field(max_length=2)


def build_bpe_thinking_model(folder: Path, tokenizer_dir: Path) -> Path:
    """A one-layer Llama on ``tokenizer_dir``'s tokenizer that writes THOUGHT, then ``</think>``, after the prompt."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = BPE_TEMPLATE
    tok.save_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False).input_ids  # as the engine encodes a chat
    chain = [prompt[-1], *tok(THOUGHT + "</think>", add_special_tokens=False).input_ids]
    assert len(set(chain)) == len(chain) and tok.decode(chain[1:]) == THOUGHT + "</think>"
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # nothing reaches the residual stream but the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight  # [vocab, hidden] both
        for i, (token, following) in enumerate(itertools.pairwise(chain)):
            embed[token] = 0.0
            embed[token, i] = 10.0  # token i of the chain points along axis i ...
            head[following] = 0.0
            head[following, i] = 10.0  # ... where only the next chain token scores (80 against < 1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def bpe_client(tmp_path_factory, default_model_dir) -> Iterator[openai.OpenAI]:
    folder = build_bpe_thinking_model(tmp_path_factory.mktemp("bpe-thinking"), default_model_dir)
    with launch_server(folder, "--kv-cache-memory", "16MiB", ui=False) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_applies_after_the_reasoning_on_a_bpe_tokenizer(bpe_client, temperature):
    kwargs = {"model": "", "messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 160,
              "temperature": temperature, "seed": 3,
              "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "person", "schema": Person.model_json_schema(),
                                                  "strict": True}}}
    choice = bpe_client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.model_extra["reasoning_content"] == THOUGHT  # free text, untouched by the grammar
    Person.model_validate_json(choice.message.content)  # the answer after </think> follows the schema
    assert choice.finish_reason == "stop"
    chunks = [c for c in bpe_client.chat.completions.create(stream=True, **kwargs) if c.choices]
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert reasoning == THOUGHT
    Person.model_validate_json(content)


def test_the_bpe_model_thinks_first_and_a_grammar_from_the_start_forbids_it(bpe_client):
    """The controls of the test above: unconstrained, the model writes THOUGHT and ``</think>``; with the grammar
    from the first token (the completions endpoint knows no reasoning), it cannot."""
    prompt = "<|im_start|>user\nDescribe a person.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    free = bpe_client.completions.create(model="", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert free.startswith(THOUGHT + "</think>")
    constrained = bpe_client.completions.create(
        model="", prompt=prompt, max_tokens=160, temperature=0,
        extra_body={"structured_outputs": {"json": Person.model_json_schema()}}).choices[0].text
    assert THOUGHT not in constrained
    Person.model_validate_json(constrained)
