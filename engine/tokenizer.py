"""Tokenizer and chat-template access (transformers' tokenizers; the template ships with the model)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.errors import EngineError

_TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")


def flatten_content(content) -> str:
    """OpenAI/Gradio message content may be a string or a list of parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or content.get("content") or "")
    if isinstance(content, (list, tuple)):
        return "".join(flatten_content(part) for part in content)
    return str(content)


def load_hf_tokenizer(model_dir: Path):
    """The folder's transformers tokenizer. When tokenizer_config.json names its class, that class is taken from
    transformers' top level and loaded directly: AutoTokenizer first builds the model's AutoConfig, and importing
    the auto-tokenizer module alone pulls in (transformers 5.17) auto_factory -> masking_utils -> torch._dynamo
    and torch.distributed: 1.5 s of every start on this machine, 6.8-8.2 s on the GPU machine (no bytecode cache
    there). Without a named class, or one transformers does not export, AutoTokenizer decides as usual."""
    import transformers

    config_file = model_dir / "tokenizer_config.json"
    name = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    cls = None
    if isinstance(name, str) and name.isidentifier():
        try:
            cls = getattr(transformers, name, None)
        except (ImportError, AttributeError):  # a tokenizer class whose optional dependency is missing
            cls = None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(model_dir))


class Tokenizer:
    """Encodes prompts and renders chat messages with the model's own chat template."""

    def __init__(self, model_dir: Path):
        try:
            self.hf = load_hf_tokenizer(Path(model_dir))
        except Exception as exc:  # transformers raises many types for a broken folder
            raise EngineError(f"cannot load the tokenizer from {model_dir}: {exc}") from exc
        # The detokenizer decodes a few tokens per request per step: the Rust tokenizer directly costs a
        # quarter of transformers' decode() wrapper (argument conversion, clean-up pass), which at 128
        # running requests was ~2 ms of every step. Same text unless the tokenizer asks for the clean-up.
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._fast_decode = None if getattr(self.hf, "clean_up_tokenization_spaces", False) else \
            getattr(backend, "decode", None)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text. Messages keep their tool fields (``tool_calls``, ``tool_call_id``, ``name``) for
        templates that render them; ``tools`` (OpenAI's function list) goes to templates that show tools."""
        if not self.hf.chat_template:
            raise EngineError("this model has no chat template; use the completions endpoint", param="messages")
        clean = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise EngineError(f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
            entry = {"role": message["role"], "content": flatten_content(message.get("content"))}
            entry.update({key: message[key] for key in _TOOL_FIELDS if message.get(key) is not None})
            clean.append(entry)
        extra = {"tools": tools} if tools else {}
        try:
            return self.hf.apply_chat_template(clean, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **extra)
        except Exception as exc:  # jinja errors from the model's template (e.g. role order rules)
            raise EngineError(f"the chat template rejected these messages: {exc}", param="messages") from exc

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Template then tokenize without adding special tokens again (the template already has them)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools),
                           add_special_tokens=False)
