"""The Server tab: the OpenAI endpoint URL, whether a key is needed, copy-paste snippets, settings, command line.

The snippets: a streamed chat, the same with curl, and a tool-calling round trip. The URL is taken from the
browser's own request (Host header) when the tab opens, so it is the address that works from where the page is
open, not the bind address. The snippets read the key from $PAGODA_API_KEY: the page never shows the key itself.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import gradio as gr

from engine.config import EngineArgs
from ui.client import EngineClient, ServerFacts


@dataclass(frozen=True)
class ServerInfo:
    base_url: str
    api_url: str
    api_key_required: bool
    model: str | None
    settings: dict
    command_line: str
    python_snippet: str
    curl_snippet: str
    tools_snippet: str


def command_line(args: EngineArgs, host: str, port: int, api_key_required: bool) -> str:
    """The `app.py serve` invocation that reproduces these settings (flags only where they differ)."""
    defaults = EngineArgs()
    parts = ["python app.py serve", f"--model {args.model}"]
    for f in fields(EngineArgs):
        name, value = f.name, getattr(args, f.name)
        if name in ("model", "force_reference_kernels") or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else f"--no-{flag[2:]}")
        else:
            parts.append(f"{flag} {value}")
    if host != "127.0.0.1":
        parts.append(f"--host {host}")
    if port != 7860:
        parts.append(f"--port {port}")
    if api_key_required:
        parts.append('--api-key "$PAGODA_API_KEY"')
    return " \\\n  ".join(parts)


def snippets(api_url: str, model: str, api_key_required: bool) -> tuple[str, str]:
    """Copy-paste examples for the openai Python client and curl (the key comes from the environment)."""
    key = 'os.environ["PAGODA_API_KEY"]' if api_key_required else '"not-needed"'
    python = (f'import os\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="{api_url}", api_key={key})\n'
              f'stream = client.chat.completions.create(\n    model="{model}",\n'
              '    messages=[{"role": "user", "content": "Write a haiku about GPUs."}],\n'
              '    max_tokens=128,\n    stream=True,\n)\n'
              'for chunk in stream:\n    print(chunk.choices[0].delta.content or "", end="", flush=True)\n')
    auth = ' \\\n  -H "Authorization: Bearer $PAGODA_API_KEY"' if api_key_required else ""
    curl = (f'curl {api_url}/chat/completions \\\n  -H "Content-Type: application/json"{auth} \\\n'
            f'  -d \'{{\n    "model": "{model}",\n    "messages": [{{"role": "user", "content": "Hello!"}}],\n'
            '    "max_tokens": 64,\n    "stream": false\n  }\'\n')
    return python, curl


def tools_snippet(api_url: str, model: str, api_key_required: bool) -> str:
    """A tool-calling round trip with the openai client: offer a function, get its call (``tool_choice``
    "required" makes even a small model call it), run it, send the result back for the answer."""
    key = 'os.environ["PAGODA_API_KEY"]' if api_key_required else '"not-needed"'
    return (f'import json\nimport os\n\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="{api_url}", '
            f'api_key={key})\n'
            'tools = [{\n    "type": "function",\n    "function": {\n        "name": "get_weather",\n'
            '        "description": "The current weather in a city",\n        "parameters": {\n'
            '            "type": "object",\n            "properties": {\n'
            '                "city": {"type": "string", "maxLength": 40},\n'
            '                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},\n            },\n'
            '            "required": ["city", "unit"],\n            "additionalProperties": False,\n        },\n    },\n}]\n'
            'messages = [{"role": "user", "content": "What is the weather in Paris?"}]\n'
            f'response = client.chat.completions.create(\n    model="{model}",\n    messages=messages,\n'
            '    tools=tools,\n    tool_choice="required",  # or "auto", "none", '
            '{"type": "function", "function": {"name": "get_weather"}}\n    max_tokens=256,\n)\n'
            'message = response.choices[0].message\nmessages.append(message.model_dump(exclude_none=True))\n'
            'for call in message.tool_calls:\n    args = json.loads(call.function.arguments)\n'
            '    print("call:", call.function.name, args)\n'
            '    result = {"city": args["city"], "temperature": 21, "unit": args["unit"]}  # run the tool here\n'
            '    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})\n'
            f'final = client.chat.completions.create(model="{model}", messages=messages, tools=tools, '
            'max_tokens=128)\nprint(final.choices[0].message.content)\n')


def server_info(facts: ServerFacts, base_url: str | None = None) -> ServerInfo:
    host = "127.0.0.1" if facts.host in ("0.0.0.0", "::", "") else facts.host
    base = (base_url or f"http://{host}:{facts.port}").rstrip("/")
    api = f"{base}/v1"
    args = facts.engine_args
    model = facts.model or args.model
    python, curl = snippets(api, model, facts.api_key_required)
    settings = {f.name: getattr(args, f.name) for f in fields(EngineArgs)}
    settings["max_model_len (effective)"] = facts.max_model_len
    return ServerInfo(base, api, facts.api_key_required, facts.model, settings,
                      command_line(args, facts.host, facts.port, facts.api_key_required), python, curl,
                      tools_snippet(api, model, facts.api_key_required))


def base_url_of(request: gr.Request | None) -> str | None:
    """scheme://host[:port] as the browser reached us, or None when unknown."""
    if request is None:
        return None
    headers = getattr(request, "headers", None) or {}
    host = headers.get("x-forwarded-host") or headers.get("host")
    if not host:
        return None
    scheme = headers.get("x-forwarded-proto") or getattr(getattr(request, "url", None), "scheme", None) or "http"
    return f"{scheme}://{host}"


def endpoint_md(info: ServerInfo) -> str:
    if info.api_key_required:
        key = ("**API key: required.** Send `Authorization: Bearer <key>` (the key given with `--api-key` or "
               "`PAGODA_API_KEY`); the snippets read it from `$PAGODA_API_KEY`. This page is behind the same "
               "key (logged in until you log out or the server restarts).")
    else:
        key = ("**API key: not required** (the server listens on this machine only; start it with `--api-key` "
               "before exposing it). Clients that insist on a key can send any string.")
    model = f"`{info.model}`" if info.model else "none loaded"
    return (f"### OpenAI-compatible endpoint\n\n<div class='endpoint' id='endpoint-url'>{info.api_url}</div>\n\n"
            f"{key}\n\nServed model id: {model} · Routes: `/v1/chat/completions`, `/v1/completions`, "
            "`/v1/models`, `/tokenize`, `/detokenize`, `/health`, `/metrics` (Prometheus, vLLM names) · "
            f"[API docs]({info.base_url}/docs)")


def settings_md(info: ServerInfo) -> str:
    lines = ["| setting | value |", "|---|---|"]
    for name, value in info.settings.items():
        shown = "default" if value is None else value
        lines.append(f"| `{name}` | `{shown}` |")
    return "\n".join(lines)


@dataclass
class ServerTab:
    outputs: list

    @staticmethod
    def values(client: EngineClient, request: gr.Request | None = None) -> tuple:
        info = server_info(client.server_facts(), base_url_of(request))
        return (endpoint_md(info), info.python_snippet, info.curl_snippet, info.tools_snippet, settings_md(info),
                info.command_line)


def build_server_tab(client: EngineClient) -> ServerTab:
    info = server_info(client.server_facts())
    endpoint = gr.Markdown(endpoint_md(info), elem_id="server-endpoint")
    if info.api_key_required:  # /logout (engine/serving/access.py) ends this browser's session
        gr.Button("Log out", link="/logout", link_target="_self", size="sm", variant="secondary",
                  elem_id="logout", scale=0)
    with gr.Row(equal_height=False):
        with gr.Column():
            python = gr.Code(info.python_snippet, language="python", label="Python (openai package)",
                             interactive=False, elem_id="snippet-python")
        with gr.Column():
            curl = gr.Code(info.curl_snippet, language="shell", label="curl", interactive=False,
                           elem_id="snippet-curl")
    tools = gr.Code(info.tools_snippet, language="python", label="Python: tool calling (tools, tool_choice)",
                    interactive=False, elem_id="snippet-tools")
    gr.Markdown("### Engine settings")
    with gr.Row(equal_height=False):
        with gr.Column():
            settings = gr.Markdown(settings_md(info), elem_id="server-settings")
        with gr.Column():
            command = gr.Code(info.command_line, language="shell", label="Command line that reproduces them",
                              interactive=False, elem_id="server-command")
    return ServerTab([endpoint, python, curl, tools, settings, command])
