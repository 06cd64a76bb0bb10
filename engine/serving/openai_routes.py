"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize.

A request becomes token ids (chat template from the model's tokenizer), SamplingParams (validated: a bad value
is a 400 naming the field), and one engine request per prompt. Non-streaming answers race the generation
against the client's disconnect; streaming answers are Server-Sent Events ending with ``data: [DONE]``, and an
error after the headers were sent (a model switch) arrives as a ``data: {"error": ...}`` event. Leaving a
stream early aborts its engine requests, which frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.async_engine import AsyncEngine
from engine.errors import EngineError, NoModelLoadedError
from engine.reasoning import (
    THINK_END,
    ReasoningSplitter,
    prompt_closes_reasoning,
    prompt_opens_reasoning,
    split_reasoning,
    template_thinks,
)
from engine.request import Logprob, RequestOutput, SamplingParams
from engine.serving import protocol as p
from engine.serving.errors import APIError, ClientDisconnected, error_payload, to_api_error
from engine.serving.structured_outputs import request_constraint
from engine.serving.tools import ToolCallStream, ToolSetup, history_tool_fields, plain_history
from engine.streams import DeltaTracker, RequestStream, SampleDelta
from engine.tokenizer import flatten_content

INLINE_TOKENIZE_CHARS = 16_384  # longer texts are tokenized in a worker thread, off the event loop
JSON_OBJECT_INSTRUCTION = "Respond only with a single valid JSON object, without any text before or after it."


# ---- request -> engine inputs --------------------------------------------------------------------------------
def served_model(engine: AsyncEngine, requested: str | None) -> str:
    """The loaded model's id if ``requested`` names it (or is empty); else a 404 model_not_found."""
    name = engine.model_name
    if name is None:
        raise NoModelLoadedError(f"no model loaded (loading {engine.loading_model})" if engine.loading_model
                                 else NoModelLoadedError().message)
    if requested in (None, "", name, engine.engine_args.model):
        return name
    raise APIError(404, f"the model '{requested}' does not exist or is not loaded; this server serves '{name}' "
                   "(see GET /v1/models, or load another one with POST /v1/models/load)",
                   param="model", code="model_not_found")


def sampling_params(req: p.SamplingRequest, max_tokens: int | None, prompt_len: int, max_model_len: int,
                    logprobs: int | None) -> SamplingParams:
    """OpenAI fields -> SamplingParams. ``max_tokens`` is clamped to the context left after the prompt."""
    room = max_model_len - prompt_len
    bias = None
    if req.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
    return SamplingParams(
        n=req.n, max_tokens=min(max_tokens, room) if max_tokens is not None else room,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        min_p=req.min_p or 0.0, repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, logprobs=logprobs, logit_bias=bias, skip_special_tokens=req.skip_special_tokens)


def chat_messages(req: p.ChatCompletionRequest) -> list[dict]:
    """Plain {"role", "content"} dicts for the chat template; JSON mode adds its instruction to the system turn."""
    messages = []
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type not in ("text", "input_text"):
                    raise APIError(400, f"content parts of type '{part.type}' are not supported (text only)",
                                   f"messages[{i}].content[{j}].type")
        content = flatten_content([part.model_dump() for part in message.content]
                                  if isinstance(message.content, list) else message.content)
        role = "system" if message.role == "developer" else message.role
        messages.append({"role": role, "content": content, **history_tool_fields(message, i)})
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        instruction = JSON_OBJECT_INSTRUCTION
        if fmt.type == "json_schema" and fmt.json_schema:
            schema = fmt.json_schema.get("schema", fmt.json_schema)
            instruction += f" It must follow this JSON schema: {json.dumps(schema)}"
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{instruction}".strip()}
        else:
            messages.insert(0, {"role": "system", "content": instruction})
    return messages


@dataclass(frozen=True)
class ReasoningState:
    """How a thinking model's output starts: inside a think block the prompt opened, or after one it closed."""

    opened: bool
    closed: bool


def reasoning_state(tokenizer, ids: list[int]) -> ReasoningState | None:
    """None for models that do not think (their template knows no ``</think>``)."""
    if not template_thinks(tokenizer.hf.chat_template):
        return None
    tail = tokenizer.decode(ids[-16:], skip_special_tokens=False)
    return ReasoningState(prompt_opens_reasoning(tail), prompt_closes_reasoning(tail))


async def off_loop(fn: Callable, *args, size: int = 0, param: str = "prompt"):
    """Tokenizer work, inline when small, in a worker thread when large (keeps the event loop responsive).
    Input the tokenizer cannot handle is the request's fault: a 400 naming ``param``, not a 500."""
    try:
        return fn(*args) if size <= INLINE_TOKENIZE_CHARS else await asyncio.to_thread(fn, *args)
    except EngineError:
        raise
    except Exception as exc:
        raise EngineError(f"cannot tokenize this input: {type(exc).__name__}", param=param) from exc


# ---- disconnects and streams -----------------------------------------------------------------------------------
async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable):
    """Await ``work``; if the client goes away first, cancel it (its finally blocks abort engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output, None))
        except Exception as exc:  # noqa: BLE001 -- re-raised by the consumer
            await queue.put((i, None, exc))
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield i, output
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its generator, so its engine requests are aborted."""

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def sse_events(chunks: AsyncIterator[dict], streams: list[RequestStream]) -> AsyncIterator[str]:
    """Chunks as SSE; an error mid-stream becomes an error event; always ``[DONE]``; aborts on early exit."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
        yield sse("[DONE]")
    except Exception as exc:  # noqa: BLE001 -- headers are sent: report it in-band
        error = to_api_error(exc)
        yield sse(error_payload(error.message, error.type, error.param, error.code))
        yield sse("[DONE]")
    finally:
        for stream in streams:
            stream.abort()


# ---- logprobs --------------------------------------------------------------------------------------------------
@dataclass
class TokenText:
    """Decoded text of single tokens (for logprobs), cached per tokenizer."""

    tokenizer: object = None
    cache: dict[int, str] = field(default_factory=dict)

    def __call__(self, tokenizer, token_id: int) -> str:
        if tokenizer is not self.tokenizer:
            self.tokenizer, self.cache = tokenizer, {}
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _top(entries: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted(entries.values(), key=lambda lp: lp.logprob, reverse=True)[:k]


def chat_logprobs(delta: SampleDelta, k: int, token_text: Callable[[int], str]) -> p.ChoiceLogprobs | None:
    if delta.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(delta.token_ids, delta.logprobs):
        chosen = entries.get(token_id) or Logprob(token_id, float("-inf"))
        top = [p.TopLogprob(token=token_text(lp.token_id), logprob=_finite(lp.logprob),
                            bytes=list(token_text(lp.token_id).encode())) for lp in _top(entries, k)]
        text = token_text(token_id)
        content.append(p.TokenLogprob(token=text, logprob=_finite(chosen.logprob), bytes=list(text.encode()),
                                      top_logprobs=top))
    return p.ChoiceLogprobs(content=content)


def completion_logprobs(delta: SampleDelta, k: int, token_text: Callable[[int], str],
                        offset: int) -> p.CompletionLogprobs | None:
    if delta.logprobs is None:
        return None
    out = p.CompletionLogprobs()
    for token_id, entries in zip(delta.token_ids, delta.logprobs):
        text = token_text(token_id)
        chosen = entries.get(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(chosen.logprob) if chosen else None)
        out.top_logprobs.append({token_text(lp.token_id): _finite(lp.logprob) for lp in _top(entries, k)})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _finite(value: float) -> float:
    return value if value > -1e30 else -9999.0  # JSON has no -inf; OpenAI reports -9999.0 for impossible tokens


def usage_of(prompt_lens: list[int], finals: list[RequestOutput | None]) -> p.UsageInfo:
    """Prompt tokens of every prompt; generated tokens summed over prompts and samples; prefix-cache hits."""
    prompt_tokens = sum(prompt_lens)
    completion = sum(len(o.token_ids) for final in finals if final is not None for o in final.outputs)
    cached = sum(final.num_cached_tokens for final in finals if final is not None)
    return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                       total_tokens=prompt_tokens + completion, prompt_tokens_details={"cached_tokens": cached})


# ---- the router ------------------------------------------------------------------------------------------------
def build_router(engine: AsyncEngine, fingerprint: str) -> APIRouter:
    """All OpenAI-compatible routes, bound to one AsyncEngine (no global state)."""
    router = APIRouter()
    token_text_cache = TokenText()

    def token_text(token_id: int) -> str:
        return token_text_cache(engine.tokenizer, token_id)

    async def start(prompts: list[list[int]], params: SamplingParams, request_id: str,
                    model: str) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await engine.add_request(rid, params=params, prompt_token_ids=ids, model=model))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    async def collect(streams: list[RequestStream]) -> list[RequestOutput | None]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, output in merged(streams):
            finals[i] = output
        return finals

    # ---- models -------------------------------------------------------------------------------------------
    @router.get("/v1/models", response_model=p.ModelList)
    async def list_models() -> p.ModelList:
        name = engine.model_name
        if name is None:
            return p.ModelList(data=[])
        root = engine.model_dir
        return p.ModelList(data=[p.ModelCard(id=name, created=int(engine.loaded_at or time.time()),
                                             root=str(root) if root else None,
                                             max_model_len=engine.max_model_len)])

    @router.get("/v1/models/{model_id:path}", response_model=p.ModelCard)
    async def get_model(model_id: str) -> p.ModelCard:
        models = (await list_models()).data
        for card in models:
            if card.id == model_id:
                return card
        raise APIError(404, f"the model '{model_id}' is not loaded", "model", "model_not_found")

    # ---- chat ---------------------------------------------------------------------------------------------
    @router.post("/v1/chat/completions", response_model=p.ChatCompletionResponse,
                 responses={400: {"model": p.ErrorResponse}, 404: {"model": p.ErrorResponse}})
    async def chat_completions(req: p.ChatCompletionRequest, request: Request) -> Response:
        model = served_model(engine, req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tokenizer, max_len = engine.tokenizer, engine.max_model_len
        tooling = ToolSetup.from_request(req, tokenizer.hf.chat_template)
        messages, template_tools = chat_messages(req), None
        if tooling is not None:
            messages, template_tools = tooling.render(messages)
        else:
            messages = plain_history(messages, tokenizer.hf.chat_template)
        size = sum(len(m["content"]) for m in messages)
        ids = await off_loop(tokenizer.encode_chat, messages, req.add_generation_prompt, template_tools, size=size,
                             param="messages")
        engine.admission.check_prompt(ids, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, req.max_completion_tokens or req.max_tokens, len(ids), max_len, k)
        params.structured_outputs = request_constraint(req)
        tool_grammar = tooling.constraint() if tooling is not None else None
        if tool_grammar is not None:
            if params.structured_outputs is not None:
                raise APIError(400, f"tool_choice '{req.tool_choice if isinstance(req.tool_choice, str) else 'named'}'"
                               " constrains the output already; drop response_format / structured_outputs",
                               "tool_choice")
            params.structured_outputs = tool_grammar
        thinking = reasoning_state(tokenizer, ids)
        if thinking is not None and params.structured_outputs is not None and not thinking.closed:
            params.structured_outputs = replace(params.structured_outputs, starts_after=THINK_END)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await unless_disconnected(request, start([ids], params, request_id, model))
        if req.stream:
            return SSEResponse(sse_events(chat_chunks(req, model, request_id, len(ids), streams[0], tooling,
                                                      thinking), streams))
        final = (await unless_disconnected(request, collect(streams)))[0]
        choices = []
        for o in final.outputs:
            reasoning, text = split_reasoning(o.text, thinking.opened) if thinking is not None else (None, o.text)
            content, calls = tooling.parse(text) if tooling is not None else (text, [])
            message = p.AssistantMessage(content=content, reasoning_content=reasoning, reasoning=reasoning,
                                         tool_calls=[p.ToolCallOut(id=c.id, function=p.FunctionCall(
                                             name=c.name, arguments=c.arguments)) for c in calls])
            choices.append(p.ChatChoice(index=o.index, message=message,
                                        logprobs=chat_logprobs(_whole(o), req.top_logprobs or 0, token_text),
                                        finish_reason="tool_calls" if calls and o.finish_reason == "stop"
                                        else o.finish_reason, stop_reason=o.stop_reason))
        return JSONResponse(p.ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage_of([len(ids)], [final]),
            system_fingerprint=fingerprint).model_dump())

    async def chat_chunks(req: p.ChatCompletionRequest, model: str, request_id: str, prompt_len: int,
                          stream: RequestStream, tooling: ToolSetup | None = None,
                          thinking: ReasoningState | None = None) -> AsyncIterator[dict]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        envelope = p.ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                         system_fingerprint=fingerprint).model_dump()

        def chunk(choices: list[p.ChatChunkChoice | dict], usage: p.UsageInfo | None = None) -> dict:
            return p.chunk_of(envelope, choices, usage)

        yield chunk([p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        tracker, last = DeltaTracker(), None
        calls = {i: ToolCallStream(tooling.format) for i in range(req.n)} if tooling is not None else {}
        splitters = {i: ReasoningSplitter(thinking.opened) for i in range(req.n)} if thinking is not None else {}
        async for output in stream:
            last = output
            usage = usage_of([prompt_len], [output]) if continuous else None
            for d in tracker.update(output):
                if d.index in calls or d.index in splitters:
                    logprobs = chat_logprobs(d, req.top_logprobs or 0, token_text)
                    for piece in tool_call_chunks(d, calls.get(d.index), splitters.get(d.index), logprobs):
                        yield chunk([piece], usage)
                    continue
                if not d.text and d.finish_reason is None and d.logprobs is None:
                    continue
                logprobs = chat_logprobs(d, req.top_logprobs or 0, token_text)
                yield chunk([p.content_choice(d.index, d.text, d.finish_reason, d.stop_reason) if logprobs is None
                             else p.ChatChunkChoice(index=d.index, delta=p.DeltaMessage(content=d.text),
                                                    logprobs=logprobs, finish_reason=d.finish_reason,
                                                    stop_reason=d.stop_reason)], usage)
        if include_usage:
            yield chunk([], usage_of([prompt_len], [last]))

    def tool_call_chunks(d: SampleDelta, calls: ToolCallStream | None, splitter: ReasoningSplitter | None,
                         logprobs) -> list[p.ChatChunkChoice]:
        """One sample's delta with tools or reasoning: reasoning first, then content, then each tool-call
        delta in its own chunk (name, then arguments), the finish reason on the last."""
        reasoning, text = splitter.feed(d.text) if splitter is not None else ("", d.text)
        if splitter is not None and d.finish_reason is not None:
            more_reasoning, more_text = splitter.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
        content, deltas = calls.feed(text) if calls is not None else (text, [])
        if calls is not None and d.finish_reason is not None:
            more_content, more = calls.finish()
            content, deltas = content + more_content, deltas + more
        pieces = [p.DeltaMessage(reasoning_content=reasoning, reasoning=reasoning)] if reasoning else []
        pieces += [p.DeltaMessage(content=content)] if content or not (deltas or pieces) else []
        pieces += [p.DeltaMessage(tool_calls=[delta]) for delta in deltas]
        if not reasoning and not content and not deltas and d.finish_reason is None and logprobs is None:
            return []
        finish = "tool_calls" if calls is not None and calls.num_calls and d.finish_reason == "stop" \
            else d.finish_reason
        return [p.ChatChunkChoice(index=d.index, delta=piece, logprobs=logprobs if k == 0 else None,
                                  finish_reason=finish if k == len(pieces) - 1 else None,
                                  stop_reason=d.stop_reason if k == len(pieces) - 1 else None)
                for k, piece in enumerate(pieces)]

    # ---- completions --------------------------------------------------------------------------------------
    @router.post("/v1/completions", response_model=p.CompletionResponse,
                 responses={400: {"model": p.ErrorResponse}, 404: {"model": p.ErrorResponse}})
    async def completions(req: p.CompletionRequest, request: Request) -> Response:
        model = served_model(engine, req.model)
        if req.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo together with logprobs is not supported (no prompt logprobs)", "echo")
        tokenizer, max_len = engine.tokenizer, engine.max_model_len
        prompts = await prompt_token_ids(req.prompt, tokenizer)
        for ids in prompts:
            engine.admission.check_prompt(ids, "prompt")
        longest = max(len(ids) for ids in prompts)
        params = sampling_params(req, req.max_tokens, longest, max_len, req.logprobs)
        params.structured_outputs = request_constraint(req)
        echoes = [tokenizer.decode(ids) if req.echo else "" for ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await unless_disconnected(request, start(prompts, params, request_id, model))
        lens = [len(ids) for ids in prompts]
        if req.stream:
            return SSEResponse(sse_events(completion_chunks(req, model, request_id, lens, echoes, streams), streams))
        finals = await unless_disconnected(request, collect(streams))
        choices = [p.CompletionChoice(index=i * req.n + o.index, text=echoes[i] + o.text,
                                      logprobs=completion_logprobs(_whole(o), req.logprobs or 0, token_text, 0),
                                      finish_reason=o.finish_reason, stop_reason=o.stop_reason)
                   for i, final in enumerate(finals) for o in final.outputs]
        return JSONResponse(p.CompletionResponse(id=request_id, model=model, choices=choices,
                                                 usage=usage_of(lens, finals),
                                                 system_fingerprint=fingerprint).model_dump())

    async def completion_chunks(req: p.CompletionRequest, model: str, request_id: str, lens: list[int],
                                echoes: list[str], streams: list[RequestStream]) -> AsyncIterator[dict]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        trackers = [DeltaTracker() for _ in streams]
        finals: list[RequestOutput | None] = [None] * len(streams)
        offsets: dict[int, int] = {}

        envelope = p.CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=None,
                                        system_fingerprint=fingerprint).model_dump()

        def chunk(choices: list[p.CompletionChoice | dict], usage: p.UsageInfo | None = None) -> dict:
            return p.chunk_of(envelope, choices, usage)

        if req.echo:
            yield chunk([p.CompletionChoice(index=i * req.n + j, text=echoes[i], finish_reason=None)
                         for i in range(len(streams)) for j in range(req.n)])
        async for i, output in merged(streams):
            finals[i] = output
            for d in trackers[i].update(output):
                index = i * req.n + d.index
                if not d.text and d.finish_reason is None and d.logprobs is None:
                    continue
                logprobs = completion_logprobs(d, req.logprobs or 0, token_text, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in (logprobs.tokens if logprobs else []))
                yield chunk([p.text_choice(index, d.text, d.finish_reason, d.stop_reason) if logprobs is None
                             else p.CompletionChoice(index=index, text=d.text, logprobs=logprobs,
                                                     finish_reason=d.finish_reason, stop_reason=d.stop_reason)])
        if include_usage:
            yield chunk([], usage_of(lens, finals))

    # ---- tokenizer ----------------------------------------------------------------------------------------
    @router.post("/tokenize", response_model=p.TokenizeResponse)
    async def tokenize(req: p.TokenizeRequest) -> p.TokenizeResponse:
        served_model(engine, req.model)
        tokenizer = engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            chat = p.ChatCompletionRequest(messages=req.messages)
            messages = chat_messages(chat)
            ids = await off_loop(tokenizer.encode_chat, messages, req.add_generation_prompt,
                                 size=sum(len(m["content"]) for m in messages), param="messages")
        else:
            ids = await off_loop(tokenizer.encode, req.prompt, req.add_special_tokens, size=len(req.prompt))
        strs = [token_text(t) for t in ids] if req.return_token_strs else None
        return p.TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)

    @router.post("/detokenize", response_model=p.DetokenizeResponse)
    async def detokenize(req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        served_model(engine, req.model)
        if any(t >= engine.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be below the vocabulary size {engine.vocab_size}", "tokens")
        return p.DetokenizeResponse(prompt=await off_loop(engine.tokenizer.decode, req.tokens,
                                                          size=len(req.tokens), param="tokens"))

    return router


async def prompt_token_ids(prompt, tokenizer) -> list[list[int]]:
    """The four prompt shapes OpenAI accepts (text, texts, token ids, lists of token ids) -> token id lists."""
    if isinstance(prompt, str):
        return [await off_loop(tokenizer.encode, prompt, size=len(prompt))]
    if prompt and isinstance(prompt[0], str):
        return [await off_loop(tokenizer.encode, text, size=len(text)) for text in prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(ids) for ids in prompt]


def _whole(output) -> SampleDelta:
    """A finished sample as one delta (non-streaming logprobs share the streaming formatter)."""
    return SampleDelta(output.index, output.text, output.token_ids, output.logprobs, output.finish_reason,
                       output.stop_reason)
