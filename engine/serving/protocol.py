"""Pydantic models of the OpenAI-compatible API: what requests may contain (with ranges) and what we return.

Field names and defaults follow OpenAI's API reference, plus vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) and ``structured_outputs``. Unknown fields are
ignored (clients such as editors send vendor fields); known fields with wrong types or out-of-range values are a 400
that names the field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_serializer


def _valid_unicode(text: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); they are not text and cannot be tokenized or echoed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the string contains invalid Unicode (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Temperature = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
TokenCount = Annotated[int, Field(ge=1, le=1_000_000)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
StopList = Annotated[list[Text], Field(max_length=16)]
MAX_N = 64
MAX_PROMPTS = 64


class APIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(APIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(APIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of the constraints. Unknown keys are a 400 (a constraint
    option that is not honoured must not be dropped silently)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | bool | Text | None = Field(None, alias="json")
    regex: Annotated[Text, Field(min_length=1, max_length=65_536)] | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=4096)] | None = None
    grammar: Annotated[Text, Field(min_length=1, max_length=262_144)] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON is always compact here: honoured either way


class FunctionDefinition(APIModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(APIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(APIModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(APIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Text = "text"
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id... are kept and ignored
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None


class SamplingRequest(APIModel):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extras)."""

    model: Text | None = Field(None, description="the served model's id (GET /v1/models); omit for the loaded one")
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: Text | StopList | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Bias] | None = Field(None, max_length=1024)
    user: Text | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: Annotated[Text, Field(min_length=1, max_length=65_536)] | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1, max_length=4096)] | None = None
    guided_grammar: Annotated[Text, Field(min_length=1, max_length=262_144)] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingRequest):
    prompt: (Annotated[Text, Field(min_length=1)]
             | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: TokenCount | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None


class TokenizeRequest(APIModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(APIModel):
    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]


class LoadModelRequest(BaseModel):
    """POST /v1/models/load: a catalog id or an existing local model folder, plus engine arguments."""

    model_config = ConfigDict(extra="forbid")
    model: Annotated[Text, Field(min_length=1, max_length=4096)]
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    max_model_len: Annotated[int, Field(ge=16, le=10_000_000)] | None = None
    max_num_seqs: Annotated[int, Field(ge=1, le=4096)] | None = None
    max_num_batched_tokens: Annotated[int, Field(ge=16, le=1_000_000)] | None = None
    block_size: Literal[8, 16, 32] | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    gpu_memory_limit: Annotated[str, Field(pattern=r"^\s*[0-9]*\.?[0-9]+\s*[a-zA-Z]{0,3}\s*$")] | None = None
    kv_cache_memory: Annotated[str, Field(pattern=r"^\s*[0-9]*\.?[0-9]+\s*[a-zA-Z]{0,3}\s*$")] | None = None
    enforce_eager: bool | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None

    def engine_overrides(self) -> dict:
        return {k: v for k, v in self.model_dump(exclude={"model"}).items() if v is not None}


# ---- responses --------------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    reasoning_content: str | None = None  # a thinking model's <think> block (engine/reasoning.py)
    reasoning: str | None = None  # the same, under vLLM's newer name


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None  # [{"index", "id", "type", "function": {"name", "arguments"}}]
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)  # OpenAI sends {"content": "..."}, not {"role": null, ...}


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


def chunk_of(envelope: dict, choices: list[BaseModel | dict], usage: UsageInfo | None) -> dict:
    """A streamed chunk as its model would dump it: ``envelope`` is the dumped chunk model without choices (its id,
    object, created, model and fingerprint, dumped once a response), choices are models or dicts from
    ``content_choice`` / ``text_choice``. Why: building and dumping the pydantic models for every token cost
    ~20 us of the event loop's Python a token (BENCHMARKS.md, "Serving path, session 11")."""
    return {**envelope, "choices": [c if isinstance(c, dict) else c.model_dump() for c in choices],
            "usage": usage.model_dump() if usage is not None else None}


def content_choice(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> dict:
    """``ChatChunkChoice(index, delta=DeltaMessage(content=text), ...).model_dump()`` of a choice without logprobs."""
    return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def text_choice(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> dict:
    """``CompletionChoice(index, text, ...).model_dump()`` of a choice without logprobs."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
