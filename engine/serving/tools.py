"""Tool calling: render the tools into the prompt, constrain ``required``/named choices, parse calls back out.

A model writes tool calls in its own format, which its chat template shows: Hermes-style
``<tool_call>{"name", "arguments"}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes), Llama 3.1's bare JSON
``{"name", "parameters"}`` (after ``<|python_tag|>``) and Mistral's ``[TOOL_CALLS][{...}, ...]``. The format
is read off the template. A template that knows no tools (the default SmolLM2) gets the tools and the Hermes
instructions in a system turn, and earlier calls and results written in Hermes form, so any chat model can
be asked. ``tool_choice: "required"`` or a named function turns into a grammar (engine/structured_output.py)
that admits only well-formed calls of the offered functions with arguments that follow their schemas, so even
a 135M model answers with a valid call; ``auto`` leaves the model free and parses whatever calls it writes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from engine.serving.errors import APIError
from engine.structured_output import StructuredOutputsParams

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
MAX_PARALLEL_CALLS = 4  # a required grammar admits at most this many calls: a small model may not stop itself
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FALLBACK_PROMPT = (
    "You may call functions to answer. The functions, as JSON schemas, are:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one <tool_call></tool_call> block per call, each holding a JSON object "
    'with the function\'s "name" and its "arguments":\n<tool_call>\n{{"name": "...", "arguments": {{...}}}}\n'
    "</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def detect_format(chat_template: str | None) -> str:
    """The call format the model was trained on, read off its chat template (Hermes when it shows none)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    return HERMES


@dataclass
class ToolSetup:
    """The tools of one chat request and how this model is asked for them and answers."""

    tools: list[dict]  # OpenAI's [{"type": "function", "function": {...}}]
    choice: str  # "auto", "required" or "named"
    named: str | None
    parallel: bool
    format: str
    native: bool  # the chat template renders ``tools`` itself

    @classmethod
    def from_request(cls, req, chat_template: str | None) -> ToolSetup | None:
        """None when the request offers no tools or says ``tool_choice: "none"``."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", "tool_choice")
            return None
        names = [t.function.name for t in req.tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tools must have distinct function names", "tools")
        if choice == "none":
            return None
        named = None
        if choice is None or choice == "auto":
            mode = "auto"
        elif choice == "required":
            mode = "required"
        else:
            mode, named = "named", choice.function.name
            if named not in names:
                raise APIError(400, f"tool_choice names the function '{named}', which is not among the tools",
                               "tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        template = chat_template or ""
        return cls(tools, mode, named, req.parallel_tool_calls is not False, detect_format(template),
                   native="tools" in template)

    # ---- prompt ---------------------------------------------------------------------------------------------
    def render(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """Messages for the chat template and the ``tools`` argument to give it (None: already in the text)."""
        if self.native:
            return messages, self.tools
        rendered = [self._as_text(m) for m in messages]
        listing = "\n".join(json.dumps(t["function"]) for t in self.tools)
        prompt = _FALLBACK_PROMPT.format(tools=listing)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{prompt}".strip()}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
        return rendered, None

    @staticmethod
    def _as_text(message: dict) -> dict:
        """An assistant turn's calls and a tool result as Hermes text, for templates that know only content."""
        if message["role"] == "assistant" and message.get("tool_calls"):
            blocks = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                      "\n</tool_call>" for c in message["tool_calls"]]
            return {"role": "assistant", "content": "\n".join([message.get("content") or "", *blocks]).strip()}
        if message["role"] == "tool":
            return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        return {"role": message["role"], "content": message.get("content") or ""}

    # ---- grammar --------------------------------------------------------------------------------------------
    def constraint(self, starts_after: str | None = None) -> StructuredOutputsParams | None:
        """The grammar of ``required`` and named choices (None for ``auto``)."""
        if self.choice == "auto":
            return None
        functions = [t["function"] for t in self.tools if self.named in (None, t["function"]["name"])]
        key = "parameters" if self.format == LLAMA3_JSON else "arguments"
        calls = [_call_schema(f, key) for f in functions]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        most = MAX_PARALLEL_CALLS if self.parallel and self.named is None else 1
        if self.format == MISTRAL:
            body = {"type": "array", "items": call, "minItems": 1, "maxItems": most, "x-guidance": _JSON_STYLE}
            lark = f"start: %json {json.dumps(body)}"
        elif self.format == LLAMA3_JSON:
            lark = f"start: %json {json.dumps({**call, 'x-guidance': _JSON_STYLE})}"
        else:
            repeat = f'("\\n" call){{0,{most - 1}}}' if most > 1 else ""
            lark = (f'start: call {repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
                    f"body: %json {json.dumps({**call, 'x-guidance': _JSON_STYLE})}")
        return StructuredOutputsParams(grammar=lark, starts_after=starts_after, param="tool_choice")

    # ---- output ---------------------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content without the calls, the calls) of a finished output; no calls: (text, [])."""
        calls, content = parse_tool_calls(text, self.format)
        if not calls:
            return text, []
        return (content or None), calls


def _call_schema(function: dict, key: str) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: parameters},
            "required": ["name", key], "additionalProperties": False}


def parse_tool_calls(text: str, fmt: str) -> tuple[list[ToolCall], str]:
    """The calls written in ``text`` (in format ``fmt``) and the text around them."""
    if fmt == HERMES:
        calls = [c for c in (_call_from_json(body) for body in _HERMES_BLOCK.findall(text)) if c is not None]
        return calls, _HERMES_BLOCK.sub("", text).strip() if calls else text
    stripped = text.strip().removeprefix("[TOOL_CALLS]").removeprefix("<|python_tag|>").strip()
    if not stripped.startswith(("{", "[")):
        return [], text
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        value = _json_objects(stripped)  # Llama 3 may separate several calls with ';'
    items = value if isinstance(value, list) else [value]
    calls = [c for c in (_call_from_obj(item) for item in items) if c is not None]
    return calls, "" if calls else text


def _json_objects(text: str) -> list:
    decoder, items, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        items.append(value)
        at = end
        while at < len(text) and text[at] in " ;\n\t,":
            at += 1
    return items


def _call_from_json(body: str) -> ToolCall | None:
    try:
        return _call_from_obj(json.loads(body))
    except json.JSONDecodeError:
        return None


def _call_from_obj(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


class ToolCallStream:
    """Turns one choice's streamed text into content deltas and tool-call deltas, the way OpenAI streams them:
    a call's first delta carries its index, id, type and name (arguments ""), the next its arguments.

    Text that may begin a call is held back: in Hermes form from ``<tool_call>`` on (and any tail that could
    grow into it), in the JSON formats the whole output once it starts with ``{``, ``[`` or a marker.
    A call goes out when its block is complete; the rest at ``finish``.
    """

    def __init__(self, setup: ToolSetup):
        self._setup = setup
        self._buffer = ""  # text not released as content yet
        self._started = False  # any content released (JSON formats: then no call can follow)
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Content that can go out now and the tool-call deltas completed by ``text``."""
        self._buffer += text
        if self._setup.format != HERMES:
            return self._feed_json()
        deltas = []
        content = ""
        while True:
            start = self._buffer.find("<tool_call>")
            if start < 0:
                keep = _marker_prefix_length(self._buffer, "<tool_call>")
                content += self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content += self._buffer[:start]
            end = self._buffer.find("</tool_call>", start)
            if end < 0:
                self._buffer = self._buffer[start:]
                break
            block, self._buffer = self._buffer[start:end + len("</tool_call>")], self._buffer[end + len("</tool_call>"):]
            deltas += self._deltas(parse_tool_calls(block, HERMES)[0])
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """The output ended: the calls still held (a last block cut short) or the held text as content."""
        calls, content = parse_tool_calls(self._buffer, self._setup.format)
        self._buffer = ""
        if not calls:
            return content, []
        return (content if self._setup.format == HERMES else ""), self._deltas(calls)

    def _feed_json(self) -> tuple[str, list[dict]]:
        if self._started:
            out, self._buffer = self._buffer, ""
            return out, []
        head = self._buffer.lstrip()
        if not head:
            return "", []
        if head.startswith(("{", "[")) or any(m.startswith(head[:len(m)]) for m in ("[TOOL_CALLS]", "<|python_tag|>")):
            return "", []  # may be calls: decided at finish
        self._started = True
        out, self._buffer = self._buffer, ""
        return out, []

    def _deltas(self, calls: list[ToolCall]) -> list[dict]:
        deltas = []
        for call in calls:
            index = self.num_calls
            self.num_calls += 1
            deltas.append({"index": index, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": index, "function": {"arguments": call.arguments}})
        return deltas


def _marker_prefix_length(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def plain_history(messages: list[dict], chat_template: str | None) -> list[dict]:
    """Without tools on offer: earlier calls and results still reach a template that knows no tools, as text."""
    if "tools" in (chat_template or "") or not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages
    return [ToolSetup._as_text(m) for m in messages]


def history_tool_fields(message, index: int) -> dict:
    """An earlier turn's tool fields for the chat template: an assistant's ``tool_calls`` (arguments parsed
    from their JSON text: templates print them with ``tojson``), a tool result's ``tool_call_id``."""
    extra = message.model_extra or {}
    fields = {}
    calls = extra.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise APIError(400, "tool_calls must be a list", f"messages[{index}].tool_calls")
        fields["tool_calls"] = [_history_call(call, index, j) for j, call in enumerate(calls)]
    if extra.get("tool_call_id") is not None:
        fields["tool_call_id"] = str(extra["tool_call_id"])
    if message.role == "tool" and message.name:
        fields["name"] = message.name
    return fields


def _history_call(call, index: int, j: int) -> dict:
    param = f"messages[{index}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, "a tool call needs a function with a name", param)
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise APIError(400, "a tool call's arguments must be JSON text", f"{param}.function.arguments") from None
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}
