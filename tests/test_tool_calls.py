"""Tool calling through the official openai client against `app.py serve` on the default model (SmolLM2-135M,
whose chat template knows no tools: the server writes them into a system turn and the grammar of ``required``
and named choices makes the call valid anyway). Arguments are checked against the tool's own schema by pydantic.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
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


def streamed_calls(chunks) -> dict[int, tuple[str, list[str]]]:
    """index -> (name, the argument pieces in the order they came) of a streamed answer's tool-call deltas."""
    calls: dict[int, tuple[str, list[str]]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index not in calls and delta.function.arguments == ""  # name first, args ""
                calls[delta.index] = (delta.function.name, [])
            else:
                assert delta.function.name is None
                calls[delta.index][1].append(delta.function.arguments)
    return calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_arguments_arrive_in_pieces_that_add_up_to_the_whole_answer(client, choice):
    kwargs = {"model": "", "messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0,
              "max_tokens": 120, "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert_valid_calls(whole.message.tool_calls)
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    calls = streamed_calls(chunks)
    assert list(calls) == [0] and calls[0][0] == whole.message.tool_calls[0].function.name
    pieces = calls[0][1]
    assert len(pieces) >= 3 and all(pieces)  # arguments as they are generated, not in one delta
    assert "".join(pieces) == whole.message.tool_calls[0].function.arguments  # the same JSON text
    ARGS[calls[0][0]].model_validate_json("".join(pieces))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def stream_text(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], int]:
    """(content, [(name, arguments)], number of argument deltas) of ``pieces`` fed one by one."""
    from engine.serving.tools import ToolCallStream, calls_from_deltas

    stream, content, deltas = ToolCallStream(fmt), "", []
    for piece in [*pieces, None]:
        text, new = stream.feed(piece) if piece is not None else stream.finish()
        content, deltas = content + text, deltas + new
    arg_deltas = sum(1 for d in deltas if "id" not in d)
    return content, [(c.name, c.arguments) for c in calls_from_deltas(deltas)], arg_deltas


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, len(text) // 3)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


NESTED = '{"city": "Pa}ris \\\\\\"{[", "days": [1, {"unit": "celsius"}], "note": "</tool_call>"}'
CHECKING = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": ' + NESTED + '}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
# (format, model output, content, [(name, arguments text)], fewest argument deltas when fed character by character)
OUTPUTS = [
    ("hermes", CHECKING, "Checking.", [("get_weather", NESTED), ("get_time", "{}")], len(NESTED) + 2),
    ("hermes", '<tool_call>{"arguments": {"timezone": "UTC"}, "name": "get_time"}</tool_call> done', " done",
     [("get_time", '{"timezone": "UTC"}')], 1),  # keys the other way round: held, then sent whole
    ("hermes", "no call, only <tool and <tool_call>broken</tool_call> text",
     "no call, only <tool and <tool_call>broken</tool_call> text", [], 0),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ' + NESTED[:30], "",
     [("get_weather", NESTED[:30])], 30),  # cut short: what was written
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + NESTED + '}; '
     '{"name": "get_time", "parameters": {"timezone": "UTC"}}', "",
     [("get_weather", NESTED), ("get_time", '{"timezone": "UTC"}')], len(NESTED) + 19),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + NESTED + '}, '
     '{"arguments": {}, "name": "get_time"}]', "", [("get_weather", NESTED), ("get_time", "{}")], len(NESTED) + 1),
    ("mistral", "[1, 2] is a list", "[1, 2] is a list", [], 0),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', [], 0),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls", "fewest_deltas"), OUTPUTS)
def test_tool_call_stream_gives_the_same_answer_whatever_the_pieces(fmt, text, content, calls, fewest_deltas):
    assert stream_text(fmt, [text])[:2] == (content, calls)
    rng = random.Random(17)
    for _ in range(30):
        assert stream_text(fmt, random_pieces(text, rng))[:2] == (content, calls)
    assert stream_text(fmt, list(text))[2] >= fewest_deltas


def test_tool_call_stream_streams_arguments_as_they_grow():
    from engine.serving.tools import HERMES, ToolCallStream

    stream = ToolCallStream(HERMES)
    assert stream.feed("Sure.\n<tool_call>\n") == ("Sure.", [])
    content, deltas = stream.feed('{"name": "get_weather", "arguments": {"ci')
    assert content == "" and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[0]["id"].startswith("call_") and deltas[0]["index"] == 0 and deltas[0]["type"] == "function"
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"ci'}}
    assert stream.feed('ty": "Paris"}') == ("", [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}])
    assert stream.in_call and stream.feed("}\n</tool_call>\n") == ("", []) and not stream.in_call
    assert stream.finish() == ("", [])  # whitespace after the call is no content


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


def test_the_server_tabs_tool_calling_snippet_runs(client):
    """The Server tab's example, run as a user would paste it, against this server: the call, then the answer."""
    from ui.server_tab import tools_snippet

    model = client.models.list().data[0].id
    snippet = tools_snippet(str(client.base_url).rstrip("/"), model, api_key_required=False)
    run = subprocess.run([sys.executable, "-c", snippet], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    printed = run.stdout.splitlines()
    assert printed[0].startswith("call: get_weather {") and "'city':" in printed[0] and len(printed) >= 2


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
