"""Grammar-constrained outputs through the official openai client against `app.py serve` on the default model.

The schemas are pydantic models, and pydantic (not the server's grammar library) validates what comes back:
every output of every schema at temperature 0 and 1 must validate. Strings, lists and numbers are bounded so
that a 135M model at temperature 1 ends its object well inside max_tokens (the grammar makes the output valid;
max_tokens would cut an unbounded one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field
from server_process import launch_server

Short = Field(max_length=12)


class Address(BaseModel):
    street: str = Short
    city: str = Short
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)
    address: Address


class Size(str, Enum):
    small = "small"
    large = "large"


class Item(BaseModel):
    sku: str = Field(max_length=8)
    size: Size
    quantity: int = Field(ge=1, le=9)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=2)
    express: bool
    note: str | None = Field(max_length=10)


class Event(BaseModel):
    kind: Literal["meeting", "call"]
    tags: list[Annotated[str, Short]] = Field(max_length=3)  # each tag bounded too: one ran past max_tokens
    priority: float = Field(ge=0, le=1)
    owner: Person


SCHEMAS = [Person, Order, Event]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def client(default_model_dir) -> Iterator[openai.OpenAI]:
    with launch_server(default_model_dir, "--kv-cache-memory", "64MiB", ui=False) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)


def ask(model: type[BaseModel]) -> list[dict]:
    return [{"role": "user", "content": f"Give me one {model.__name__.lower()} as JSON."}]


def json_schema_format(model: type[BaseModel]) -> dict:
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": model.model_json_schema(),
                                                   "strict": True}}


def test_json_schema_outputs_validate_at_temperature_0_and_1(client):
    def run(model: type[BaseModel], temperature: float):
        n = 1 if temperature == 0 else 3
        resp = client.chat.completions.create(model="", messages=ask(model), temperature=temperature, n=n,
                                              max_tokens=MAX_TOKENS, response_format=json_schema_format(model))
        return model, resp

    jobs = [(model, t) for model in SCHEMAS for t in (0.0, 1.0)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # one batch in the engine: the runs share its steps
        results = list(pool.map(lambda job: run(*job), jobs))
    checked = 0
    for model, resp in results:
        for choice in resp.choices:
            assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
            model.model_validate_json(choice.message.content)  # raises on any deviation from the schema
            checked += 1
    assert checked == len(SCHEMAS) * 4


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(model="", messages=ask(Person), response_format=Person,
                                               temperature=0, max_tokens=MAX_TOKENS)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person)
    assert message.parsed == Person.model_validate_json(message.content)


def test_json_object_is_one_json_object(client):
    resp = client.chat.completions.create(model="", messages=ask(Person), temperature=1.0, max_tokens=MAX_TOKENS,
                                          response_format={"type": "json_object"}, seed=7)
    choice = resp.choices[0]
    if choice.finish_reason == "stop":  # an unbounded object may run past max_tokens at temperature 1
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


def test_structured_outputs_choice_and_regex(client):
    choices = ["positive", "negative", "neutral"]
    resp = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Is 'I love it' positive or negative?"}], n=3,
        temperature=1.0, max_tokens=10, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in resp.choices)
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    resp = client.completions.create(model="", prompt="A product code:", n=3, temperature=1.0, max_tokens=16,
                                      extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in resp.choices)
    stream = client.completions.create(model="", prompt="Yes or no?", max_tokens=8, stream=True, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("yes", "no")


def test_structured_outputs_grammar_lark_and_gbnf(client):
    lark = 'start: greeting " " name\ngreeting: "hello" | "goodbye"\nname: /[a-z]{2,5}/'
    gbnf = 'root ::= ("up" | "down") " " [0-9]'
    for grammar, pattern in ((lark, r"(hello|goodbye) [a-z]{2,5}"), (gbnf, r"(up|down) [0-9]")):
        resp = client.completions.create(model="", prompt="Say something:", max_tokens=12, temperature=1.0,
                                          extra_body={"structured_outputs": {"grammar": grammar}})
        assert re.fullmatch(pattern, resp.choices[0].text), resp.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_a_grammar_that_cannot_compile_is_a_400_naming_the_field(client, body, param):
    response_format = body.pop("response_format", None)
    kwargs = {"response_format": response_format} if response_format else {}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=ask(Person), max_tokens=4, extra_body=body, **kwargs)
    assert info.value.body["param"] == param
    assert info.value.body["message"]


# ---- engine level: the mask in the sampler, preemption, n > 1 -------------------------------------------------
def test_token_masks_forbid_exactly_the_unset_bits():
    import numpy as np
    import torch

    from engine.request import Request, SamplingParams
    from engine.sampler import Sampler, apply_token_masks
    from engine.structured_output import TokenMasks

    vocab = 70  # three 32-bit words, the last one partly past the vocabulary
    allowed = [{3, 31, 32, 69}, {0, 63}]
    bitmask = np.full((3, 3), -1, dtype=np.int32)  # row 1 unconstrained: all ones
    for row, ids in ((0, allowed[0]), (2, allowed[1])):
        bitmask[row] = 0
        for i in ids:
            bitmask[row, i // 32] |= np.uint32(1 << (i % 32)).view(np.int32)
    logits = torch.randn(3, vocab)
    masks = TokenMasks(bitmask)
    masked = apply_token_masks(logits, masks)
    for row, ids in ((0, allowed[0]), (2, allowed[1])):
        finite = set(torch.nonzero(torch.isfinite(masked[row])).flatten().tolist())
        assert finite == ids
    assert torch.equal(masked[1], logits[1])  # an unconstrained row is untouched
    requests = [Request(f"r{i}", [1], SamplingParams(temperature=1.0, max_tokens=None)) for i in range(3)]
    for seed in range(20):
        out = Sampler(seed=seed).sample_async(logits, requests, masks).result()
        assert out.token_ids[0] in allowed[0] and out.token_ids[2] in allowed[1]


def test_grammars_survive_preemption_and_n_samples(default_model_dir):
    from engine import LLM
    from engine.request import SamplingParams
    from engine.structured_output import StructuredOutputsParams

    # ~8 blocks of 16 tokens for 6 requests of ~25 prompt + 24 output tokens: preemption by recompute is forced.
    llm = LLM(str(default_model_dir), dtype="float32", device="cpu", kv_cache_memory="6MiB", max_num_seqs=6)
    pattern = r"[a-z]{6} [0-9]{4}-[0-9]{4} (yes|no)"
    params = SamplingParams(n=2, temperature=1.0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    prompts = [f"Write a code for case number {i} of the big list of codes:" for i in range(3)]
    outputs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    for output in outputs:
        for sample in output.outputs:
            assert sample.finish_reason == "stop" and re.fullmatch(pattern, sample.text), sample.text
    assert llm.engine.structured.num_requests == 0  # every matcher freed
    assert llm.engine.structured.num_compiled == 1  # one compile for six matchers


def test_a_grammar_opens_at_a_token_boundary_after_its_marker(default_model_dir):
    """SmolLM2's BPE has tokens like '>"' that can end '</think'; the grammar would start after that token and
    never see its quote. While a grammar waits for its marker, such tokens are masked: the marker must end a token
    (the default model's tokenizer, a JSON-schema constraint that starts after </think>)."""
    from types import SimpleNamespace

    import numpy as np

    from engine.structured_output import StructuredOutputManager, StructuredOutputsParams
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_dir)
    manager = StructuredOutputManager(tokenizer, len(tokenizer.hf), (2,), max_rows=4)
    params = StructuredOutputsParams.from_schema({"type": "object"}, starts_after="</think>")
    manager.add(["r"], params)
    ids = tokenizer.hf.encode

    def allowed(output_text: str) -> tuple[set[int], set[int]] | None:
        request = SimpleNamespace(request_id="r", output_token_ids=ids(output_text, add_special_tokens=False))
        masks = manager.token_masks([request])
        if masks is None:
            return None
        bits = np.unpackbits(masks.bitmask[0].view(np.uint8), bitorder="little")
        return {i for i in range(len(bits)) if bits[i]}, {i for i in range(len(bits)) if not bits[i]}

    quote_close = ids('>"', add_special_tokens=False)
    close = ids(">", add_special_tokens=False)
    assert len(quote_close) == 1 and len(close) == 1  # one token each in this vocabulary
    ok, banned = allowed("Let me think about it.</think")
    assert quote_close[0] in banned and close[0] in ok
    for token in banned:  # every banned token finishes the marker and carries text past it
        text = "</think" + tokenizer.decode([token], skip_special_tokens=False)
        assert "</think>" in text and not text.endswith("</think>")
    assert len(banned) < 200
    # far from the marker the reasoning samples freely, unless a token holds the whole marker and more
    free = allowed("Let me think about it")
    if free is not None:
        assert all("</think>" in tokenizer.decode([t], skip_special_tokens=False) for t in free[1])
    # once the marker is out, the grammar has the row
    request = SimpleNamespace(request_id="r", output_token_ids=ids("Thinking.</think>", add_special_tokens=False))
    manager.accept(request, request.output_token_ids[-1])
    assert manager.token_masks([request]) is not None
