"""The Chat tab: streaming multi-turn chat with sampling controls, stop/regenerate/edit/clear, per-reply stats.

The conversation lives in a ``gr.State`` as plain ``{"role", "content", "stats"}`` dicts (the canonical
history the chat template sees; a reply also keeps its ``reasoning`` and whether it is still ``live``); the
Chatbot only displays it: a thinking model's reasoning as a collapsible "thought" (open with a spinner while
the model thinks, closed once it answers), the answer, each tool call the model wrote as a card titled with
the function's name and its arguments as indented JSON, and the reply's token counts and speed last. Chat
events run with no Gradio concurrency limit so that several browser tabs chatting at once reach the engine
together and are batched there.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
from collections.abc import AsyncIterator
from dataclasses import dataclass

import gradio as gr

from engine.tokenizer import flatten_content
from ui.client import ChatSettings, EngineClient, ReplyChunk, ToolCallView, UIError, answer_parts

DEFAULT_SYSTEM_PROMPT = "You are a helpful, concise assistant."


@dataclass
class ChatTab:
    """The components other tabs and the app wire to."""

    chatbot: gr.Chatbot
    history: gr.State


def render(history: list[dict]) -> list[dict]:
    """Chatbot messages for the canonical history: each reply as its parts, its stats line last."""
    messages = []
    for turn in history:
        if turn.get("role") == "assistant":
            messages += reply_messages(turn)
        else:
            messages.append({"role": turn["role"], "content": flatten_content(turn.get("content"))})
    return messages


def reply_messages(turn: dict) -> list[dict]:
    """One reply: its reasoning (a thought), its text, a card per tool call, the stats line under the last."""
    live = bool(turn.get("live"))
    shown = []
    if turn.get("reasoning") or turn.get("thinking"):
        thinking = bool(turn.get("thinking"))
        shown.append({"role": "assistant", "content": turn.get("reasoning") or "",
                      "metadata": {"title": "Thinking…" if thinking else "Reasoning",
                                   "status": "pending" if thinking else "done"}})
    text, calls = answer_parts(flatten_content(turn.get("content")), live)
    if text:
        shown.append({"role": "assistant", "content": text})
    shown += [tool_call_card(call, live) for call in calls]
    if turn.get("stats"):
        footer = f"<span class='reply-stats'>{html.escape(turn['stats'])}</span>"
        if text and not calls:  # the text is the last part: the line goes under it
            shown[-1] = {"role": "assistant", "content": f"{text}\n\n{footer}"}
        else:
            shown.append({"role": "assistant", "content": footer})
    return shown or [{"role": "assistant", "content": ""}]


def tool_call_card(call: ToolCallView, live: bool) -> dict:
    """A tool call as its own message: the function's name as the title, the arguments as a JSON block
    (a spinner while they are still being written)."""
    body = call.pretty_arguments()
    fence = "````" if "```" in body else "```"
    metadata = {"title": f"Tool call: {call.name}"}
    if live and not call.complete:
        metadata["status"] = "pending"
    return {"role": "assistant", "content": f"{fence}json\n{body}\n{fence}", "metadata": metadata}


def reply_turn(chunk: ReplyChunk) -> dict:
    """The canonical history entry of a reply so far."""
    return {"role": "assistant", "content": chunk.text, "reasoning": chunk.reasoning, "thinking": chunk.thinking,
            "live": not chunk.finished, "stats": chunk.stats.describe()}


def settled(turn: dict) -> dict:
    """A reply that will grow no more (stopped or cut off): nothing in it is shown as in progress."""
    return {**turn, "live": False, "thinking": False}


def hidden() -> dict:
    return gr.update(visible=False, value="")


def error_box(message: str) -> dict:
    return gr.update(visible=True, value=f"<div class='note note-error' role='alert'>⚠ {html.escape(message)}</div>")


def parse_seed(text: str | None) -> int | None:
    text = (text or "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise UIError(f"The seed must be a whole number ≥ 0 (or empty for a random seed), not '{text[:40]}'.")
    return int(text)


def parse_settings(system: str, temperature: float, top_p: float, top_k: float, max_tokens: float,
                   seed: str | None, stop: str) -> ChatSettings:
    """The controls' values as ChatSettings; UIError for values the sampler would refuse."""
    if not 0 < float(top_p) <= 1:
        raise UIError("Top-p must be in (0, 1].")
    # one per line; a typed "\n" or "\t" stands for a newline / tab (a stop on "\n\n" ends at a blank line)
    stops = tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in (stop or "").splitlines() if s.strip())
    return ChatSettings(system_prompt=system or "", temperature=float(temperature), top_p=float(top_p),
                        top_k=int(top_k or 0), max_tokens=max(1, int(max_tokens or 1)),
                        seed=parse_seed(seed), stop=stops)


class ReplyControl:
    """Stop signals for the reply streaming in each browser tab (keyed by Gradio's session hash).

    Why not Gradio's ``cancels=``: a cancelled event leaves its outputs in an error state in the page. Here the
    Stop button only sets an event; the streaming handler sees it, closes the engine stream (which aborts the
    request and frees its KV blocks at once) and ends normally with the partial reply marked "stopped".
    ``discard`` (Clear, Edit, a new message) ends the old stream without a last update, so it cannot overwrite
    what the newer action shows.
    """

    def __init__(self):
        self._current: dict[str, tuple[asyncio.Event, list[bool]]] = {}

    def begin(self, session: str) -> tuple[asyncio.Event, list[bool]]:
        self.stop(session, discard=True)
        signal = (asyncio.Event(), [False])
        self._current[session] = signal
        return signal

    def stop(self, session: str, discard: bool = False) -> bool:
        signal = self._current.get(session)
        if signal is None:
            return False
        signal[1][0] = signal[1][0] or discard
        signal[0].set()
        return True

    def end(self, session: str, signal: tuple[asyncio.Event, list[bool]]) -> None:
        if self._current.get(session) is signal:
            del self._current[session]


async def until_stopped(items: AsyncIterator, stop: asyncio.Event) -> AsyncIterator:
    """The items of ``items`` until ``stop`` is set, then ``items`` is closed (aborting the engine request)."""
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while True:
            step = asyncio.ensure_future(items.__anext__())
            await asyncio.wait({step, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await step
                return
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stopper.cancel()
        await items.aclose()


async def stream_reply(client: EngineClient, history: list[dict], settings: ChatSettings,
                       signal: tuple[asyncio.Event, list[bool]]) -> AsyncIterator[tuple]:
    """Yield (history, chatbot, error, stats line, header status) while the reply to ``history`` streams in.

    The header's model line is refreshed when a reply starts and ends, so a tab notices a model switch made
    from another tab.
    """
    stop, discard = signal
    reply = {"role": "assistant", "content": "", "stats": "", "live": True}
    shown = [*history, reply]
    yield shown, render(shown), hidden(), "Generating …", client.model_summary()
    try:
        async for chunk in until_stopped(client.chat_stream(history, settings), stop):
            reply = reply_turn(chunk)
            shown = [*history, reply]
            status = client.model_summary() if chunk.finished else gr.update()
            yield shown, render(shown), gr.update(), f"**Last reply:** {reply['stats']}", status
    except UIError as exc:
        gr.Warning(exc.message)
        kept = [*history, settled(reply)] if reply["content"] or reply.get("reasoning") else history
        yield kept, render(kept), error_box(exc.message), "", client.model_summary()  # a partial reply stays
        return
    if stop.is_set() and not discard[0]:
        reply = {**settled(reply), "stats": (reply["stats"] or "0 tokens") + " · stopped"}
        shown = [*history, reply]
        yield shown, render(shown), gr.update(), f"**Stopped.** {reply['stats']}", gr.update()


def build_chat_tab(client: EngineClient, status: gr.Markdown) -> ChatTab:
    """``status`` is the header's model line (refreshed as replies start and end)."""
    history = gr.State([])
    with gr.Row(equal_height=False):
        with gr.Column(scale=4):
            chatbot = gr.Chatbot(elem_id="chatbot", height=540, show_label=False, buttons=["copy", "copy_all"],
                                 placeholder="**Start a conversation.** Replies stream token by token; the "
                                             "line under each reply shows its token counts and speed.",
                                 feedback_options=None, group_consecutive_messages=False)
            error = gr.HTML(visible=False, elem_id="chat-error")
            with gr.Row(equal_height=True):
                message = gr.Textbox(show_label=False, lines=1, max_lines=10, scale=8, elem_id="chat-input",
                                     placeholder="Message the model …  (Enter sends, Shift+Enter adds a line)",
                                     autofocus=True)
                send = gr.Button("Send", variant="primary", scale=1, min_width=90, elem_id="chat-send")
            with gr.Row():
                stop = gr.Button("■ Stop", size="sm", variant="stop", elem_id="chat-stop")
                regenerate = gr.Button("↻ Regenerate", size="sm", elem_id="chat-regenerate")
                edit = gr.Button("✎ Edit last message", size="sm", elem_id="chat-edit")
                clear = gr.Button("Clear chat", size="sm", elem_id="chat-clear")
            stats_line = gr.Markdown(elem_id="reply-stats", elem_classes=["stats-line"])
        with gr.Column(scale=1, min_width=280, elem_classes=["side-panel"]):
            gr.Markdown("### Generation settings")
            system = gr.Textbox(DEFAULT_SYSTEM_PROMPT, label="System prompt", lines=3, max_lines=8,
                                elem_id="system-prompt")
            temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature",
                                    info="0 = greedy (deterministic)", elem_id="temperature")
            top_p = gr.Slider(0.05, 1.0, value=0.95, step=0.01, label="Top-p", elem_id="top-p")
            top_k = gr.Slider(0, 200, value=0, step=1, label="Top-k", info="0 = off", elem_id="top-k")
            max_tokens = gr.Slider(1, 4096, value=512, step=1, label="Max new tokens", elem_id="max-tokens")
            seed = gr.Textbox(label="Seed", placeholder="random", info="a whole number for repeatable replies",
                              elem_id="seed")
            stop_seqs = gr.Textbox(label="Stop sequences", info="one per line", lines=2, elem_id="stop-seqs")
    controls = [system, temperature, top_p, top_k, max_tokens, seed, stop_seqs]
    outputs = [message, history, chatbot, error, stats_line, status]

    control = ReplyControl()

    def refuse(turns: list[dict], message: str) -> tuple:
        gr.Warning(message)
        return gr.update(), turns, render(turns), error_box(message), gr.update(), gr.update()

    async def reply(shown: list[dict], asked: list[dict], message_box, settings_args: tuple, request: gr.Request):
        """Send and regenerate share this: parse the settings (refusing with ``shown`` left on screen), then
        stream the assistant's reply to ``asked``; ``message_box`` is what the message box shows meanwhile."""
        try:
            settings = parse_settings(*settings_args)
        except UIError as exc:
            yield refuse(shown, exc.message)
            return
        signal = control.begin(request.session_hash)
        try:
            async for update in stream_reply(client, asked, settings, signal):
                yield message_box, *update
        finally:
            control.end(request.session_hash, signal)

    async def respond(text: str, turns: list[dict], system: str, temperature: float, top_p: float, top_k: float,
                      max_new: float, seed: str, stops: str, request: gr.Request):
        text = (text or "").strip()
        if not text:
            yield refuse(turns, "Type a message first: the message is empty.")
            return
        asked = [*turns, {"role": "user", "content": text}]
        settings_args = (system, temperature, top_p, top_k, max_new, seed, stops)
        async for update in reply(turns, asked, "", settings_args, request):
            yield update

    async def regenerate_last(turns: list[dict], system: str, temperature: float, top_p: float, top_k: float,
                              max_new: float, seed: str, stops: str, request: gr.Request):
        turns = list(turns)
        while turns and turns[-1]["role"] == "assistant":
            turns.pop()
        if not turns:
            yield refuse(turns, "Nothing to regenerate yet: send a message first.")
            return
        settings_args = (system, temperature, top_p, top_k, max_new, seed, stops)
        async for update in reply(turns, turns, gr.update(), settings_args, request):
            yield update

    def edit_last(turns: list[dict], request: gr.Request):
        control.stop(request.session_hash, discard=True)
        last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
        if last_user is None:
            return refuse(turns, "There is no message to edit yet.")
        kept = turns[:last_user]
        text = flatten_content(turns[last_user]["content"])
        return text, kept, render(kept), hidden(), "Editing your last message: change it and press Send.", \
            gr.update()

    def stop_reply(request: gr.Request) -> None:
        control.stop(request.session_hash)

    def clear_chat(request: gr.Request):
        control.stop(request.session_hash, discard=True)
        return [], [], hidden(), "", ""

    # no Gradio concurrency limit: tabs chatting at once reach the engine together and are batched there;
    # no loading overlays: the stats line says "Generating …" and the reply itself streams in
    free = {"concurrency_limit": None, "show_progress": "hidden"}
    message.submit(respond, [message, history, *controls], outputs, **free)
    send.click(respond, [message, history, *controls], outputs, **free)
    regenerate.click(regenerate_last, [history, *controls], outputs, **free)
    stop.click(stop_reply, None, None, queue=False)
    edit.click(edit_last, [history], outputs, **free)
    clear.click(clear_chat, None, [history, chatbot, error, stats_line, message], queue=False)
    return ChatTab(chatbot, history)
