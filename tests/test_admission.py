"""One admission path: the offline LLM, the AsyncEngine (the API's and the UI's engine) and the UI client refuse and
accept the same prompts, at the same boundary (a prompt must leave room for one output token), naming the field
the caller gave."""

from __future__ import annotations

import asyncio

import pytest

from engine.admission import Admission, check_prompt_length
from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.errors import EngineError
from engine.llm import LLM
from engine.request import SamplingParams
from ui.client import ChatSettings, EngineClient, UIError
from ui.model_manager import ModelManager

MAX_LEN = 64
ONE = SamplingParams(max_tokens=1, temperature=0.0)


def test_the_rules():
    admission = Admission(max_model_len=8, vocab_size=100)
    admission.check_prompt([1] * 7)  # leaves one token
    for ids, code in (([1] * 8, "context_length_exceeded"), ([], None), ([1, 100], None), ([1, -1], None),
                      ([1, True], None)):
        with pytest.raises(EngineError) as info:
            admission.check_prompt(ids, "messages")
        assert info.value.param == "messages" and info.value.code == code, ids
    with pytest.raises(EngineError) as info:
        admission.check_params(SamplingParams(stop_token_ids=[100]))
    assert info.value.param == "stop_token_ids"
    assert admission.output_room(5) == 3
    check_prompt_length(8, 8, min_output_tokens=0)  # the scheduler's own rule: it can compute a full context


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_model_len=MAX_LEN, kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def engine(default_model_dir):
    engine = AsyncEngine(EngineArgs(model=str(default_model_dir), max_model_len=MAX_LEN, kv_cache_memory="8MiB"))
    yield engine
    engine.shutdown()


def test_the_offline_llm_and_the_async_engine_share_the_boundary(llm, engine):
    fits, too_long = [1] * (MAX_LEN - 1), [1] * MAX_LEN
    assert llm.generate({"prompt_token_ids": fits}, ONE)[0].finished
    with pytest.raises(EngineError) as info:
        llm.generate({"prompt_token_ids": too_long}, ONE)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt")

    async def first(ids, **kwargs):
        async for output in engine.generate(params=ONE, prompt_token_ids=ids, **kwargs):
            return output

    assert asyncio.run(first(fits)).finished
    with pytest.raises(EngineError) as info:
        asyncio.run(first(too_long, prompt_param="messages"))
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(EngineError) as info:
        asyncio.run(first([1, engine.vocab_size]))
    assert info.value.param == "prompt"
    assert engine.stats()["num_waiting"] == 0 and llm.stats()["num_waiting"] == 0


def test_the_ui_refuses_what_the_engine_refuses(engine, tmp_path):
    client = EngineClient(engine, models=ModelManager(engine, state_path=tmp_path / "models.json"))
    try:
        with pytest.raises(UIError, match="context"):
            asyncio.run(anext(client.chat_stream([{"role": "user", "content": "hi " * MAX_LEN}], ChatSettings())))
        chunks = asyncio.run(collect(client.chat_stream([{"role": "user", "content": "hi"}], ChatSettings(max_tokens=2))))
        assert chunks[-1].finished
    finally:
        client.close()


async def collect(stream):
    return [chunk async for chunk in stream]
