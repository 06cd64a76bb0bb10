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

from engine.reasoning import marker_prefix_length
from engine.serving.errors import APIError
from engine.structured_output import StructuredOutputsParams

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
MAX_PARALLEL_CALLS = 4  # a required grammar admits at most this many calls: a small model may not stop itself
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_MARKERS = ("[TOOL_CALLS]", "<|python_tag|>")
# a call's start up to its arguments object: {"name": "...", "arguments": (or Llama's "parameters") then {
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_FALLBACK_PROMPT = (
    "You may call functions to answer. The functions, as JSON schemas, are:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one <tool_call></tool_call> block per call, each holding a JSON object "
    'with the function\'s "name" and its "arguments":\n<tool_call>\n{{"name": "...", "arguments": {{...}}}}\n'
    "</tool_call>")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=new_call_id)


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
        """(content without the calls, the calls) of a finished output; no calls: (text, []). Read by the
        streaming parser in one piece, so a streamed answer's argument deltas add up to these arguments."""
        stream = ToolCallStream(self.format)
        content, deltas = stream.feed(text)
        rest, more = stream.finish()
        calls = calls_from_deltas(deltas + more)
        if not calls:
            return text, []
        return (content + rest).strip() or None, calls


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
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Turns one choice's text, piece by piece, into content deltas and tool-call deltas the way OpenAI streams
    them: a call's first delta carries its index, id, type and name (arguments ""), each later one the next
    piece of its arguments' JSON text, as the model writes it.

    A call streams once its header is read: ``{"name": "...", "arguments": `` followed by ``{`` (the order in
    which every format's template shows it and the tool grammar writes it). From there the arguments object
    goes out as it grows, up to its closing brace (found by following strings and nesting, so a brace in a
    string does not end it). A call written otherwise (keys the other way round, arguments as a string) is
    held until its end and sent as name, then all its arguments. The same machine reads whole outputs
    (``ToolSetup.parse``), so the streamed pieces always add up to the non-streamed arguments; a call cut
    short or malformed after its header stays a call with its arguments as written (OpenAI's may be invalid
    JSON too; under ``required`` and named choices the grammar makes them valid).

    Hermes form: text outside ``<tool_call>...</tool_call>`` is content (a tail that could grow into the marker
    is held, and whitespace just before a call is dropped); a block that holds no call goes out as content. The
    JSON formats: an output that starts with ``{``, ``[`` or a marker may be calls and is not content; calls
    follow each other after ``,`` or ``;``, and text after the last one is dropped.
    """

    def __init__(self, fmt: str):
        self.format = fmt
        self.num_calls = 0
        self._phase = "text" if fmt == HERMES else "open"
        self._buffer = ""  # text received and not handled yet
        self._space = ""  # trailing whitespace of the content, held: dropped if a call follows
        self._raw = ""  # JSON formats: the whole output, content again if it holds no call
        self._value: _ValueEnd | None = None

    @property
    def in_call(self) -> bool:
        """A call has started and its end has not come yet."""
        return self._phase in ("header", "arguments", "rest")

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Content that can go out now and the tool-call deltas that ``text`` completes."""
        self._buffer += text
        if self.format != HERMES:
            self._raw += text
        content: list[str] = []
        deltas: list[dict] = []
        while getattr(self, f"_{self._phase}")(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[dict]]:
        """The output ended: a call still held goes out whole (or as content if it holds none)."""
        content: list[str] = []
        deltas: list[dict] = []
        held, self._buffer = self._buffer, ""
        if self._phase == "header" and self.format == HERMES:
            self._whole_block(held, content, deltas, closed=False)
        elif self._phase == "header":
            for call in parse_tool_calls(held, self.format)[0]:
                deltas += self._call_deltas(call)
            if not self.num_calls:
                content.append(self._raw)
        elif self._phase in ("text", "open"):
            content.append(held)
        self._phase = "done"
        tail = self._space + "".join(content)
        self._space = ""
        return (tail.rstrip() if self.num_calls else tail), deltas

    # ---- phases: each handles the buffer; True when it moved to another phase that should look at it ----------
    def _text(self, content: list[str], deltas: list[dict]) -> bool:
        """Hermes, outside a block."""
        start = self._buffer.find(_OPEN)
        if start < 0:
            cut = len(self._buffer) - marker_prefix_length(self._buffer, _OPEN)
            content.append(self._release(self._buffer[:cut]))
            self._buffer = self._buffer[cut:]
            return False
        content.append(self._release(self._buffer[:start]))
        self._buffer, self._phase = self._buffer[start + len(_OPEN):], "header"
        return True

    def _open(self, content: list[str], deltas: list[dict]) -> bool:
        """JSON formats, at the start: calls (after a marker and ``[``) or plain content?"""
        head = self._buffer.lstrip()
        for marker in _MARKERS:
            if len(head) < len(marker) and marker.startswith(head):
                return False  # nothing yet, or what may still become the marker
            if head.startswith(marker):
                head = head[len(marker):].lstrip()
        if not head:
            return False
        if head.startswith("["):
            head = head[1:].lstrip()
            if not head:
                return False
        if head.startswith("{"):
            self._buffer, self._phase = head, "header"
        else:
            self._phase = "plain"
        return True

    def _header(self, content: list[str], deltas: list[dict]) -> bool:
        """Inside a call, before its arguments: stream from here if the header reads as name, then arguments."""
        match = _HEADER.match(self._buffer)
        name = _json_string(match.group(1)) if match else None
        if name is not None:
            deltas.append(self._start_call(name))
            self._buffer, self._phase, self._value = self._buffer[match.end():], "arguments", _ValueEnd()
            return True
        end = self._buffer.find(_CLOSE) if self.format == HERMES else -1
        if end < 0:
            return False  # Hermes: until the block ends; JSON formats: until the output does
        body, self._buffer = self._buffer[:end], self._buffer[end + len(_CLOSE):]
        self._whole_block(body, content, deltas)
        self._phase = "text"
        return True

    def _arguments(self, content: list[str], deltas: list[dict]) -> bool:
        """The arguments object goes out as it arrives, up to its closing brace."""
        end = self._value.scan(self._buffer)
        piece = self._buffer if end is None else self._buffer[:end]
        self._buffer = "" if end is None else self._buffer[end:]
        if piece:
            deltas.append({"index": self.num_calls - 1, "function": {"arguments": piece}})
        if end is None:
            return False
        self._phase, self._value = "rest", _ValueEnd(depth=1)  # still inside the call object
        return True

    def _rest(self, content: list[str], deltas: list[dict]) -> bool:
        """After the arguments: the end of the block (Hermes) or of the call object (JSON formats)."""
        if self.format == HERMES:
            end = self._buffer.find(_CLOSE)
            if end < 0:
                self._buffer = self._buffer[len(self._buffer) - marker_prefix_length(self._buffer, _CLOSE):]
                return False
            self._buffer, self._phase = self._buffer[end + len(_CLOSE):], "text"
            return True
        end = self._value.scan(self._buffer)
        self._buffer = "" if end is None else self._buffer[end:]
        if end is None:
            return False
        self._phase = "between"
        return True

    def _between(self, content: list[str], deltas: list[dict]) -> bool:
        """JSON formats, after a call: another one, or the end of the calls."""
        self._buffer = self._buffer.lstrip(" \t\r\n,;")
        if not self._buffer:
            return False
        self._phase = "header" if self._buffer.startswith("{") else "done"
        return True

    def _plain(self, content: list[str], deltas: list[dict]) -> bool:
        content.append(self._buffer)
        self._buffer = ""
        return False

    def _done(self, content: list[str], deltas: list[dict]) -> bool:
        self._buffer = ""
        return False

    # ---- helpers ------------------------------------------------------------------------------------------
    def _release(self, text: str) -> str:
        """Content up to its last non-space character; the trailing whitespace waits for what follows."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        return body

    def _whole_block(self, body: str, content: list[str], deltas: list[dict], closed: bool = True) -> None:
        """A Hermes block read whole: its call, or the block as content when it holds none."""
        call = _call_from_json(body.strip())
        if call is None:
            content.append(self._release(_OPEN + body + (_CLOSE if closed else "")))
            return
        deltas += self._call_deltas(call)

    def _start_call(self, name: str, call_id: str | None = None) -> dict:
        self._space = ""  # whitespace before a call is not content
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return {"index": index, "id": call_id or new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _call_deltas(self, call: ToolCall) -> list[dict]:
        first = self._start_call(call.name, call.id)
        return [first, {"index": first["index"], "function": {"arguments": call.arguments}}]


def calls_from_deltas(deltas: list[dict]) -> list[ToolCall]:
    """The calls that a list of streamed tool-call deltas adds up to."""
    names: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if "id" in delta:
            names[delta["index"]] = (delta["function"]["name"], delta["id"])
        arguments.setdefault(delta["index"], []).append(delta["function"]["arguments"])
    return [ToolCall(name, "".join(arguments[index]), call_id) for index, (name, call_id) in sorted(names.items())]


@dataclass
class _ValueEnd:
    """Where a JSON value that opens with ``{`` or ``[`` closes, read piece by piece: strings and their escapes
    are followed, so a brace inside a string does not count. ``depth`` 1 starts inside an object."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> int | None:
        """The index just past the value's end in ``text``, or None when the value goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _json_string(body: str) -> str | None:
    """The value of a JSON string literal's inside (escapes decoded), None if it is not one."""
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return None


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
