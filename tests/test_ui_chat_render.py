"""What the chat shows, driven through the chat tab's handler (ui.chat_tab.stream_reply) and the real EngineClient:
a thinking model's reasoning as a collapsible thought (open with a spinner while it thinks, closed after), the
answer, a tool call the model wrote as a card titled with the function and holding its arguments as indented
JSON, the stats line last. The engine serves the random-weight forced-``<think>`` model of tests/test_reasoning.py;
for tool output its generation is replaced by scripted model text (a random model writes no call), everything
else (tokenizer, chat template, admission, the client's reasoning split) is the real engine's.
"""

from __future__ import annotations

import asyncio
import html
import json
from collections.abc import AsyncIterator

import gradio as gr
import pytest
from test_reasoning import build_thinking_model

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.reasoning import split_reasoning
from engine.request import CompletionOutput, RequestOutput
from ui.chat_tab import reply_messages, stream_reply
from ui.client import ChatSettings, EngineClient, chat_messages
from ui.model_manager import ModelManager

ASK = [{"role": "user", "content": "w5 w6 w7"}]
REASONING = "The user asks for the weather in Paris, so the get_weather tool fits."
ARGUMENTS = {"city": "Paris", "unit": "celsius", "days": [1, 2]}
ANSWER = ("Let me check.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGUMENTS})
          + "\n</tool_call>")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = build_thinking_model(tmp_path_factory.mktemp("thinking"))
    eng = AsyncEngine(EngineArgs(model=str(folder), kv_cache_memory="16MiB", seed=0))
    yield eng
    eng.shutdown()


class ScriptedEngine:
    """The real engine in all but generation, which replays ``text`` a few characters per output."""

    def __init__(self, engine: AsyncEngine, text: str, step: int = 4):
        self._engine, self._text, self._step = engine, text, step

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, *, prompt_token_ids: list[int], params, prompt_param: str) -> AsyncIterator:
        ends = list(range(self._step, len(self._text), self._step)) + [len(self._text)]
        for i, end in enumerate(ends):
            done = end == len(self._text)
            sample = CompletionOutput(0, self._text[:end], list(range(i + 1)), "stop" if done else None)
            yield RequestOutput("scripted", None, prompt_token_ids, [sample], done)
            await asyncio.sleep(0)


def client_of(engine, tmp_path) -> EngineClient:
    return EngineClient(engine, models=ModelManager(engine, state_path=tmp_path / "ui-models.json"),
                        sample_interval=60)


def updates(client: EngineClient, settings: ChatSettings) -> list[tuple]:
    """Every (history, chatbot messages, ...) the handler yields for one reply to ASK."""

    async def drive():
        return [update async for update in stream_reply(client, ASK, settings, (asyncio.Event(), [False]))]

    return asyncio.run(drive())


def is_stats_line(message: dict) -> bool:
    return "metadata" not in message and message["content"].startswith("<span class='reply-stats'>")


def test_reasoning_of_a_thinking_model_is_a_collapsed_thought_above_the_answer(engine, tmp_path):
    """Several seeds: a random model closes its think block in some replies (answer below the thought) and
    not in others (the thought alone); both must show as the API's splitter reads the same output."""
    client = client_of(engine, tmp_path)
    try:
        for seed in range(6):
            check_reasoning_reply(client, engine, ChatSettings(system_prompt="", temperature=1.0, max_tokens=64,
                                                               seed=seed))
    finally:
        client.close()


def check_reasoning_reply(client: EngineClient, engine: AsyncEngine, settings: ChatSettings) -> None:
    history, shown = updates(client, settings)[-1][:2]

    async def reference() -> str:  # the same request straight from the engine
        ids = engine.tokenizer.encode_chat(chat_messages(ASK, ""))
        async for output in engine.generate(prompt_token_ids=ids, params=settings.sampling_params(64)):
            last = output
        return last.outputs[0].text

    raw = asyncio.run(reference())
    reasoning, answer = split_reasoning(raw, in_reasoning=True)
    assert raw.startswith(reasoning) and reasoning.strip()  # the template forces <think>: it starts thinking
    assert shown[0] == ASK[0]
    assert shown[1] == {"role": "assistant", "content": reasoning,
                        "metadata": {"title": "Reasoning", "status": "done"}}
    footer = f"<span class='reply-stats'>{html.escape(history[-1]['stats'])}</span>"
    below = f"{answer}\n\n{footer}" if answer else footer  # the answer (if any) with the stats line under it
    assert shown[2:] == [{"role": "assistant", "content": below}]
    assert history[-1]["content"] == answer and history[-1]["reasoning"] == reasoning
    assert chat_messages(history, "")[-1] == {"role": "assistant", "content": answer}  # no reasoning next turn


def test_a_tool_call_is_a_card_with_its_arguments_as_json(engine, tmp_path):
    client = client_of(ScriptedEngine(engine, f"{REASONING}</think>\n\n{ANSWER}"), tmp_path)
    try:
        seen = updates(client, ChatSettings(system_prompt=""))
    finally:
        client.close()
    history, shown = seen[-1][0], seen[-1][1]
    assert [m.get("metadata") for m in shown[1:]] == [
        {"title": "Reasoning", "status": "done"}, None, {"title": "Tool call: get_weather"}, None]
    assert shown[1]["content"] == REASONING and shown[2]["content"] == "Let me check."
    card = shown[3]["content"]
    assert card.startswith("```json\n") and card.endswith("\n```") and '\n  "city": "Paris"' in card
    assert json.loads(card.removeprefix("```json\n").removesuffix("\n```")) == ARGUMENTS
    assert is_stats_line(shown[4]) and "tok/s" in shown[4]["content"]
    accepted = gr.Chatbot(group_consecutive_messages=False).postprocess(shown).model_dump()
    assert [m["metadata"] for m in accepted] == [m.get("metadata") for m in shown]  # Gradio keeps the titles

    while_thinking = [u[1][1] for u in seen[1:] if u[1][1].get("metadata", {}).get("status") == "pending"]
    assert while_thinking and all(m["metadata"]["title"] == "Thinking…" for m in while_thinking)
    assert all(REASONING.startswith(m["content"]) for m in while_thinking)
    growing = [m for u in seen for m in u[1] if m.get("metadata", {}).get("title") == "Tool call: get_weather"
               and m["metadata"].get("status") == "pending"]
    assert len(growing) >= 3  # the card appears with the name and fills in as the arguments stream
    assert all("<tool_call>" not in m["content"] for u in seen for m in u[1])  # never shown as raw text
    assert history[-1]["content"] == ANSWER  # the template sees the call as the model wrote it


def test_a_plain_reply_is_one_message_with_its_stats_line():
    assert reply_messages({"role": "assistant", "content": "Hello.", "stats": "2 tokens"}) == [
        {"role": "assistant", "content": "Hello.\n\n<span class='reply-stats'>2 tokens</span>"}]
    assert reply_messages({"role": "assistant", "content": "", "stats": "", "live": True}) == [
        {"role": "assistant", "content": ""}]
