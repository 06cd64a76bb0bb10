"""Tool calling through the official openai client against `app.py serve` on the default model (SmolLM2-135M,
whose chat template knows no tools: the server writes them into a system turn and the grammar of ``required``
and named choices makes the call valid anyway). Arguments are checked against the tool's own schema by pydantic.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from server_process import launch_server


class WeatherArgs(BaseModel):
    city: str = Field(max_length=16)
    unit: Literal["celsius", "fahrenheit"]


class TimeArgs(BaseModel):
    timezone: str = Field(max_length=16)


def tool(name: str, description: str, args: type[BaseModel]) -> dict:
    schema = {**args.model_json_schema(), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [tool("get_weather", "The current weather in a city", WeatherArgs),
         tool("get_time", "The current time in a timezone", TimeArgs)]
ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(default_model_dir) -> Iterator[openai.OpenAI]:
    with launch_server(default_model_dir, "--kv-cache-memory", "64MiB", ui=False) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)


def assert_valid_calls(calls, names=tuple(ARGS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        ARGS[call.function.name].model_validate_json(call.function.arguments)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_gives_valid_calls(client, temperature):
    resp = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=temperature, max_tokens=120, parallel_tool_calls=False)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls)


def test_named_choice_calls_that_function_streamed_like_openai(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = {"model": "", "messages": ASK, "tools": TOOLS, "tool_choice": named, "temperature": 0, "max_tokens": 80}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert_valid_calls(whole.message.tool_calls, names=("get_time",))
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_time" and deltas[0].id.startswith("call_") and deltas[0].index == 0
    assert all(d.function.name is None for d in deltas[1:])  # name first, then argument deltas
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == json.loads(whole.message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_result_round_trip(client):
    first = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=120, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    second = client.chat.completions.create(model="", messages=history, tools=TOOLS, temperature=0, max_tokens=24)
    answer = second.choices[0].message
    assert answer.content or answer.tool_calls  # "auto": prose or another call
    if answer.tool_calls and second.choices[0].finish_reason == "tool_calls":
        assert_valid_calls(answer.tool_calls)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the call and its result are in it
    final = client.chat.completions.create(model="", messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_tool_errors_are_400s(client):
    cases = [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tool_choice": "required", "tools": None}, "tool_choice"),
             ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
             ({"tools": TOOLS + TOOLS[:1]}, "tools")]
    for extra, param in cases:
        kwargs = {"model": "", "messages": ASK, "tools": TOOLS, "max_tokens": 4, **extra}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**kwargs)
        assert info.value.body["param"] == param, extra


def test_parsers_of_each_format():
    from engine.serving.tools import HERMES, LLAMA3_JSON, MISTRAL, parse_tool_calls

    calls, content = parse_tool_calls('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', HERMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})] and content == "Sure."
    calls, _ = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": 2}}', LLAMA3_JSON)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 2})]
    calls, _ = parse_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]', MISTRAL)
    assert [c.name for c in calls] == ["f", "g"]
    assert parse_tool_calls("just text", HERMES) == ([], "just text")
