"""The OpenAI-compatible API as the official ``openai`` client sees it, against `app.py serve` on a free port.

Expected values come from independent sources: token counts from the model's own HF tokenizer and chat
template, stop-string cuts from a greedy run without the stop, greedy choices from the reported logprobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_process import launch_server

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key-123"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(default_model_dir) -> Iterator[str]:
    with launch_server(default_model_dir, "--api-key", API_KEY, "--kv-cache-memory", "64MiB") as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def test_models_lists_the_loaded_model(client, default_model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [default_model_dir.name]
    assert client.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_completion_greedy_usage_and_logprobs(client, model_id, hf_tokenizer):
    resp = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    expected_prompt = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.usage.prompt_tokens == len(expected_prompt)
    tokens = choice.logprobs.content
    assert resp.usage.completion_tokens == len(tokens)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert len(tokens) == 8
    for token in tokens:  # greedy: the chosen token is the most likely one
        assert len(token.top_logprobs) == 3
        assert token.logprob == pytest.approx(max(t.logprob for t in token.top_logprobs), abs=1e-4)
    assert "".join(t.token for t in tokens).startswith(choice.message.content)
    assert choice.message.content


def test_chat_streaming_matches_non_streaming_and_reports_usage(client, model_id):
    kwargs = {"model": model_id, "messages": CHAT, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(chunks[-1].usage, field) == getattr(whole.usage, field)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_usage(client, model_id, hf_tokenizer):
    prompt = "The capital of France is"
    resp = client.completions.create(model=model_id, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    choice = resp.choices[0]
    assert resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(hf_tokenizer(prompt)["input_ids"])
    assert resp.usage.completion_tokens == len(choice.logprobs.tokens)
    assert "".join(choice.logprobs.tokens).startswith(choice.text)
    assert choice.finish_reason in ("stop", "length")
    echoed = client.completions.create(model=model_id, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + choice.text
    streamed = client.completions.create(model=model_id, prompt=prompt, max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_completions_batch_of_prompts_and_token_ids(client, model_id, hf_tokenizer):
    prompts = ["Once upon a time", "1, 2, 3,"]
    resp = client.completions.create(model=model_id, prompt=prompts, max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == sum(len(hf_tokenizer(p)["input_ids"]) for p in prompts)
    ids = hf_tokenizer(prompts[1])["input_ids"]
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == next(c.text for c in resp.choices if c.index == 2)


def test_n2_returns_two_samples_and_sums_usage(client, model_id):
    resp = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=6, temperature=1.0, n=2,
                                          seed=7, logprobs=True)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)
    stream = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=6, temperature=1.0, n=2,
                                            seed=7, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in resp.choices}


def test_stop_string_cuts_the_greedy_text(client, model_id):
    prompt = "Count: 1, 2, 3, 4, 5,"
    free = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0).choices[0]
    words = free.text.split()
    assert len(words) >= 3, free.text
    stop = words[2]
    cut = free.text.index(stop)
    stopped = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0,
                                        stop=[stop]).choices[0]
    assert stopped.text == free.text[:cut]
    assert stopped.finish_reason == "stop"


def test_same_seed_same_text_at_temperature_one(client, model_id):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=12, temperature=1.0,
                                              seed=seed).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_api_key_is_required_on_v1(server, model_id):
    for key in (None, "wrong-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(f"{server}/v1/chat/completions", headers=headers,
                       json={"model": model_id, "messages": CHAT, "max_tokens": 1})
        assert r.status_code == 401
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server}/health").status_code == 200  # the liveness probe stays open, nothing else
    for path in ("/metrics", "/version", "/docs", "/openapi.json", "/"):
        assert httpx.get(f"{server}{path}").status_code == 401, path


def test_errors_are_openai_shaped_and_name_the_field(server, client, model_id):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=1, top_p=1.5)
    assert info.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as info:
        max_len = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
                            ).json()["data"][0]["max_model_len"]
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi " * max_len}],
                                       max_tokens=1)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=1, logit_bias={"99999999": 5})
    assert info.value.body["param"] == "logit_bias"


def test_vllm_extras_and_json_mode_are_accepted(client, model_id):
    resp = client.chat.completions.create(
        model=model_id, messages=CHAT, max_tokens=4, temperature=0.8, response_format={"type": "json_object"},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 4})
    assert resp.usage.completion_tokens == 4 and resp.choices[0].finish_reason == "length"


def test_tokenize_detokenize_round_trip(server, hf_tokenizer):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = "Paged attention, in blocks of 16 tokens."
    tok = httpx.post(f"{server}/tokenize", json={"prompt": text}, headers=headers).json()
    assert tok["tokens"] == hf_tokenizer(text)["input_ids"] and tok["count"] == len(tok["tokens"])
    back = httpx.post(f"{server}/detokenize", json={"tokens": tok["tokens"]}, headers=headers).json()
    assert back["prompt"] == text
    chat = httpx.post(f"{server}/tokenize", json={"messages": CHAT}, headers=headers).json()
    assert chat["tokens"] == hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                              return_dict=True)["input_ids"]


def test_ui_is_mounted_next_to_the_api(server):
    """The API shares its app with the browser UI, behind the same key (tests/test_ui_access.py has the rest)."""
    r = httpx.get(f"{server}/", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]


def test_health_version_and_metrics(server, model_id):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server}/health").json()["model"] == model_id
    assert httpx.get(f"{server}/version", headers=headers).json()["version"]
    metrics = httpx.get(f"{server}/metrics", headers=headers).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket"):
        assert f'{name}{{' in metrics or f"{name}_total{{" in metrics, name
    assert f'model_name="{model_id}"' in metrics


@pytest.mark.parametrize(("finish", "stop"), [(None, None), ("stop", None), ("stop", 13), ("stop", "END"),
                                              ("length", None)])
def test_streamed_chunks_built_from_dicts_are_what_the_models_dump(finish, stop):
    """The streaming hot path builds a plain token's choice as a dict (engine/serving/protocol.py): the wire
    format must be the pydantic models' own dump, field for field."""
    from engine.serving import protocol as p

    text = 'h\u00e9llo "x"\n'
    usage = p.UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    chat = p.ChatChunkChoice(index=2, delta=p.DeltaMessage(content=text), finish_reason=finish, stop_reason=stop)
    completion = p.CompletionChoice(index=1, text=text, finish_reason=finish, stop_reason=stop)
    assert p.content_choice(2, text, finish, stop) == chat.model_dump()
    assert p.text_choice(1, text, finish, stop) == completion.model_dump()
    envelope = p.ChatCompletionChunk(id="c", created=1, model="m", choices=[], system_fingerprint="f").model_dump()
    whole = p.ChatCompletionChunk(id="c", created=1, model="m", choices=[chat, chat], usage=usage,
                                  system_fingerprint="f").model_dump()
    assert p.chunk_of(envelope, [p.content_choice(2, text, finish, stop), chat], usage) == whole
    assert list(p.chunk_of(envelope, [chat], None)) == list(whole)  # keys in the model's order
