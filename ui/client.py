"""EngineClient: the one object the UI talks to (chat streams, dashboard snapshots, models, server facts).

Why one object: the tabs must work the same whatever model is loaded (or none), while a model switch replaces
the engine underneath them. Every UI callback goes through this client, which turns engine errors into
``UIError`` messages a person can act on, reads the engine's counters as consistent snapshots, and keeps the
small amount of UI-side state (throughput history, added models, running downloads) off module level.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineArgs, resolve_device
from engine.errors import EngineError, EngineStepError
from engine.reasoning import ReasoningSplitter, prompt_opens_reasoning, template_thinks
from engine.request import SamplingParams
from engine.serving.tools import HERMES, ToolCallStream, calls_from_deltas
from engine.snapshot import EngineSnapshot
from engine.tokenizer import flatten_content
from ui.model_manager import ModelManager, UIError

log = logging.getLogger("pagoda.ui")

HISTORY_SECONDS = 600
MEMORY_MAX_AGE = 1.0  # seconds: the dashboard asks the engine loop for a newer memory report than that


def explain(exc: BaseException) -> str:
    """The readable sentence for an engine-side failure (the same classes the HTTP API maps to 4xx/503).

    Errors without a user-facing message are unexpected: they are logged with their traceback (a bug to
    fix) and summarised in one line for the page.
    """
    if isinstance(exc, (UIError, EngineError)):
        return exc.message
    message = getattr(exc, "message", None)  # EngineUnavailableError and subclasses carry one
    if isinstance(message, str):
        return message
    if isinstance(exc, EngineStepError):  # already logged by the engine loop
        return str(exc)
    log.error("unexpected error in the UI", exc_info=exc)
    return f"unexpected error ({type(exc).__name__}: {exc}); the server log has the details"


# ---- chat ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatSettings:
    """The sampling controls of the chat tab."""

    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    max_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=list(self.stop) or None)


@dataclass(frozen=True)
class ReplyStats:
    """Token counts and speed of one reply (shown under it)."""

    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    elapsed_s: float
    first_token_s: float | None
    finish_reason: str | None = None

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first over the time after the first (time to first token apart)."""
        if self.first_token_s is None or self.completion_tokens == 0:
            return 0.0
        decode_time = self.elapsed_s - self.first_token_s
        if self.completion_tokens > 1 and decode_time > 0:
            return (self.completion_tokens - 1) / decode_time
        return self.completion_tokens / max(self.elapsed_s, 1e-6)

    def describe(self) -> str:
        parts = [_count(self.completion_tokens, "token"), f"{self.tokens_per_s:.1f} tok/s"]
        cached = f", {self.cached_tokens} cached" if self.cached_tokens else ""
        parts.append(f"prompt {_count(self.prompt_tokens, 'token')}{cached}")
        if self.first_token_s is not None:
            parts.append(f"first token {self.first_token_s:.2f} s")
        parts.append(f"{self.elapsed_s:.1f} s")
        reason = {"stop": "finished", "length": "hit max tokens", "abort": "stopped"}.get(
            self.finish_reason or "", self.finish_reason)
        if reason:
            parts.append(reason)
        return " · ".join(parts)


@dataclass(frozen=True)
class ReplyChunk:
    """The reply so far and its stats. ``text`` is the answer as the model wrote it (cumulative, tool calls
    included: the chat template sees it again next turn); a thinking model's ``reasoning`` is apart, and
    ``thinking`` says its think block is still open."""

    text: str
    stats: ReplyStats
    finished: bool
    reasoning: str = ""
    thinking: bool = False


def reasoning_splitter(tokenizer, prompt_ids: list[int]) -> ReasoningSplitter | None:
    """A splitter for a model that thinks (its template knows ``</think>``), None for the others; the output
    starts inside the think block when the prompt opened it (the same reading as the API's)."""
    if not template_thinks(tokenizer.hf.chat_template):
        return None
    tail = tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False)
    return ReasoningSplitter(prompt_opens_reasoning(tail))


@dataclass
class ReplyText:
    """One reply's text as its cumulative outputs arrive: a thinking model's reasoning apart from its answer."""

    splitter: ReasoningSplitter | None
    reasoning: str = ""
    answer: str = ""
    finished: bool = False
    _seen: int = 0

    def update(self, text: str, finished: bool) -> None:
        """``text``: the sample's whole text so far."""
        new, self._seen = text[self._seen:], len(text)
        self.finished = finished
        if self.splitter is None:
            self.answer += new
            return
        reasoning, answer = self.splitter.feed(new)
        if finished:
            more_reasoning, more_answer = self.splitter.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        self.reasoning, self.answer = self.reasoning + reasoning, self.answer + answer

    @property
    def thinking(self) -> bool:
        return self.splitter is not None and self.splitter.thinking and not self.finished


@dataclass(frozen=True)
class ToolCallView:
    """A tool call the model wrote, as the chat shows it."""

    name: str
    arguments: str  # JSON text as written; still growing while ``complete`` is False
    complete: bool

    def pretty_arguments(self) -> str:
        """The arguments indented, or as written while they are not (yet) JSON."""
        try:
            return json.dumps(json.loads(self.arguments), indent=2, ensure_ascii=False)
        except json.JSONDecodeError:
            return self.arguments


def answer_parts(answer: str, live: bool = False) -> tuple[str, list[ToolCallView]]:
    """(the answer's text without its tool calls, the calls) for display.

    Calls are read in Hermes form (``<tool_call>{"name", "arguments"}</tool_call>``): Pagoda asks any model
    that knows no tools for that form, Qwen and Hermes models write it, and its marker cannot be mistaken for
    prose. The bare-JSON forms of Llama 3 and Mistral are not read here: the chat offers no tools, and a JSON
    answer shown as a call would be wrong. ``live``: the reply is still streaming, so a tail that may become a
    call is not shown yet and the last call may still be growing.
    """
    stream = ToolCallStream(HERMES)
    content, deltas = stream.feed(answer)
    growing = live and stream.in_call
    if not live:
        rest, more = stream.finish()
        content, deltas = content + rest, deltas + more
    calls = calls_from_deltas(deltas)
    if not calls:
        return content, []
    views = [ToolCallView(c.name, c.arguments, complete=not (growing and i == len(calls) - 1))
             for i, c in enumerate(calls)]
    return content.strip(), views


def chat_messages(history: list[dict], system_prompt: str) -> list[dict]:
    """Template-ready messages: flattened content (Gradio 6 passes lists of parts), system prompt first."""
    messages = [{"role": "system", "content": system_prompt.strip()}] if system_prompt.strip() else []
    for message in history:
        role = message.get("role")
        if role in ("user", "assistant", "system"):
            messages.append({"role": role, "content": flatten_content(message.get("content"))})
    return messages


# ---- dashboard -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThroughputSample:
    """Tokens per second over one sampling interval, stamped with wall-clock time."""

    time: float
    prompt_tps: float
    generation_tps: float


@dataclass(frozen=True)
class RequestRowView:
    request_id: str
    state: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    blocks: int
    preemptions: int


@dataclass(frozen=True)
class DashboardSnapshot:
    """Everything the dashboard draws, read at one moment."""

    model: str | None
    loading: str | None
    device: str  # "cuda" | "cpu"
    stats: dict
    memory: dict | None
    rows: list[RequestRowView]
    history: list[ThroughputSample]
    taken_at: float = field(default_factory=time.time)


def memory_segments(memory: dict, device: str) -> dict[str, int]:
    """Bytes per segment; they add up to the device's (or, on CPU, the system's) total memory.

    On a GPU, used = ours (weights, KV, activations) + allocator cache and CUDA context + other processes; the
    activation reserve is clamped to what is really in use (an emptied allocator cache gives it back).
    """
    weights, kv_alloc = memory["weights"], memory["kv_allocated"]
    kv_used = min(memory["kv_in_use"], kv_alloc)
    activations = memory["activation_reserve"] + memory.get("cuda_graph_pool", 0)
    if device == "cuda":
        used = memory["device_used"]
        activations = min(activations, max(used - weights - kv_alloc, 0))
        ours = weights + kv_alloc + activations
        other = min(memory["other_processes"], max(used - ours, 0))
        ours_other = max(used - ours - other, 0)
    else:  # used = this process (RSS) + other processes
        ours_other = max(memory["process_rss"] - weights - kv_alloc - activations, 0)
        other = memory["other_processes"]
    return {"weights": weights, "kv_in_use": kv_used, "kv_free": kv_alloc - kv_used, "activations": activations,
            "ours_other": ours_other, "other_processes": other, "free": memory["device_free"]}


class ThroughputSampler:
    """A daemon thread that turns the engine's cumulative token counters into tokens/s once a second.

    Reading a stats snapshot is a dict copy, so sampling costs nothing noticeable; doing it in the background
    (not on dashboard ticks) keeps the history complete while nobody looks at the page.
    """

    def __init__(self, read_stats, interval: float = 1.0, keep_seconds: float = HISTORY_SECONDS):
        self._read_stats = read_stats
        self.interval = interval
        self.samples: deque[ThroughputSample] = deque(maxlen=int(keep_seconds / interval) + 1)
        self._last: tuple[float, Any, int, int] | None = None  # (monotonic, model identity, prompt, generation)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagoda-ui-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # never let a transient read kill the sampler
                log.debug("throughput sample failed", exc_info=True)

    def sample(self) -> None:
        stats = self._read_stats()
        now = time.monotonic()
        identity = (stats.get("model_name"), stats.get("loaded_at"))
        prompt, gen = int(stats.get("prompt_tokens_total") or 0), int(stats.get("generation_tokens_total") or 0)
        last, self._last = self._last, (now, identity, prompt, gen)
        if last is None:
            return
        dt = max(now - last[0], 1e-6)
        same = last[1] == identity and prompt >= last[2] and gen >= last[3]
        d_prompt, d_gen = (prompt - last[2], gen - last[3]) if same else (prompt, gen)  # counters restart on switch
        self.samples.append(ThroughputSample(time.time(), d_prompt / dt, d_gen / dt))

    def history(self) -> list[ThroughputSample]:
        return list(self.samples)

    def close(self) -> None:
        self._stop.set()


# ---- server facts --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerFacts:
    """What the Server tab describes: where the API listens, whether it wants a key, what is served and how."""

    host: str
    port: int
    api_key_required: bool
    model: str | None
    engine_args: EngineArgs
    max_model_len: int | None


# ---- the client ----------------------------------------------------------------------------------------------
class EngineClient:
    """Wraps the AsyncEngine, the model catalog/downloads/fit checks, and the throughput history."""

    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 7860, api_key_required: bool = False,
                 models: ModelManager | None = None, sample_interval: float = 1.0):
        self.engine = engine
        self.host, self.port, self.api_key_required = host, port, api_key_required
        self.models = models or ModelManager(engine)
        self.sampler = ThroughputSampler(self._stats, sample_interval)

    def close(self) -> None:
        self.sampler.close()
        self.models.close()

    # ---- what is served ---------------------------------------------------------------------------------
    @property
    def model_name(self) -> str | None:
        return self.engine.model_name

    @property
    def loading_model(self) -> str | None:
        return self.engine.loading_model

    @property
    def device_type(self) -> str:
        return resolve_device(self.engine.engine_args.device).type

    def model_summary(self) -> str:
        """One line for the page header: what is served, where, and its context length."""
        name, loading = self.model_name, self.loading_model
        if name is None:
            return f"Loading **{loading}** …" if loading else "No model loaded — pick one in the **Models** tab"
        device = "GPU" if self.device_type == "cuda" else "CPU"
        context = self._stats().get("max_model_len")
        suffix = f" · context {context:,} tokens" if context else ""
        busy = f" · loading {loading} …" if loading else ""
        return f"Serving **{name}** on {device}{suffix}{busy}"

    def _stats(self, snapshot: EngineSnapshot | None = None) -> dict:
        """The counters of ``snapshot`` (default: the latest one) with what is served, as a flat dict."""
        snapshot = snapshot or self.engine.snapshot()
        stats = snapshot.stats() if snapshot else {}
        stats.update(model_name=snapshot.model_name if snapshot else None, loading=self.loading_model,
                     max_model_len=snapshot.max_model_len if snapshot else None)
        stats.setdefault("loaded_at", getattr(self.engine, "loaded_at", None))
        return stats

    # ---- chat -------------------------------------------------------------------------------------------
    async def chat_stream(self, history: list[dict], settings: ChatSettings) -> AsyncIterator[ReplyChunk]:
        """Stream the assistant's reply to ``history`` (whose last message is the user's) token by token, a
        thinking model's reasoning apart from its answer.

        Raises UIError with a readable message for an empty message, no model, a prompt longer than the
        context, bad sampling values, or a model switch mid-reply (the partial text was already yielded).
        """
        if not history or history[-1].get("role") != "user" or not flatten_content(history[-1].get("content")).strip():
            raise UIError("Type a message first: the message is empty.")
        try:
            tokenizer = self.engine.tokenizer
            model, max_len = self.engine.model_name, self.engine.max_model_len
            prompt_ids = tokenizer.encode_chat(chat_messages(history, settings.system_prompt))
            admission = self.engine.admission  # the API's and the offline LLM's checks (engine/admission.py)
            try:
                admission.check_prompt(prompt_ids, "messages")
            except EngineError as exc:
                if exc.code != "context_length_exceeded":
                    raise
                raise UIError(f"The conversation is {len(prompt_ids):,} tokens but {model}'s context is "
                              f"{max_len:,} tokens: clear the chat or remove earlier messages.") from exc
            params = settings.sampling_params(max(1, min(settings.max_tokens, admission.output_room(len(prompt_ids)))))
            admission.check_params(params)
            reply = ReplyText(reasoning_splitter(tokenizer, prompt_ids))
        except UIError:
            raise
        except Exception as exc:
            raise UIError(explain(exc)) from exc
        async for chunk in self._generate(prompt_ids, params, model, reply):
            yield chunk

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, model: str,
                        reply: ReplyText) -> AsyncIterator[ReplyChunk]:
        started = time.monotonic()
        first: float | None = None
        tokens, cached = 0, 0
        try:
            async with aclosing(self.engine.generate(prompt_token_ids=prompt_ids, params=params,
                                                     prompt_param="messages")) as outputs:
                async for output in outputs:
                    sample = output.outputs[0]
                    reply.update(sample.text, output.finished)
                    tokens = len(sample.token_ids)
                    cached = output.num_cached_tokens or 0
                    if first is None and tokens:
                        first = time.monotonic() - started
                    stats = ReplyStats(model, len(prompt_ids), cached, tokens, time.monotonic() - started, first,
                                       sample.finish_reason)
                    yield ReplyChunk(reply.answer, stats, output.finished, reply.reasoning, reply.thinking)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            if _is_switch(exc):
                raise UIError(f"{explain(exc)}: this reply was cut off after {tokens} tokens. "
                              "Regenerate to continue with the model now loaded.") from exc
            raise UIError(explain(exc)) from exc

    # ---- dashboard --------------------------------------------------------------------------------------
    def dashboard(self) -> DashboardSnapshot:
        """Stats, memory report and per-request rows of one engine snapshot (the engine loop publishes one
        after every step: nothing here reads engine internals, so nothing can change while it is read)."""
        snapshot = self.engine.snapshot(max_memory_age=MEMORY_MAX_AGE, wait=0.2)
        stats = self._stats(snapshot)
        memory = snapshot.memory.report.as_dict() if snapshot and snapshot.memory else None
        rows = [RequestRowView(r.request_id, r.state, r.num_prompt_tokens, r.num_output_tokens, r.num_cached_tokens,
                               r.num_blocks, r.num_preemptions) for r in (snapshot.requests if snapshot else ())]
        return DashboardSnapshot(snapshot.model_name if snapshot else None, self.loading_model, self.device_type,
                                 stats, memory, rows, self.sampler.history())

    # ---- models -----------------------------------------------------------------------------------------
    async def load_model(self, row_id: str, max_model_len: int | None = None):
        """Switch to a model from the table; returns the engine's LoadInfo. UIError on any refusal."""
        if self.loading_model:
            raise UIError(f"{self.loading_model} is loading right now: wait for it to finish.")
        ref = self.models.load_reference(row_id)
        overrides = {"max_model_len": int(max_model_len)} if max_model_len else {}
        try:
            return await self.engine.switch_model(ref, **overrides)
        except EngineError as exc:
            raise UIError(f"Could not load {row_id}: {exc.message}") from exc
        except Exception as exc:  # out of memory, a file the loader did not anticipate... (explain logs it)
            raise UIError(f"Could not load {row_id}: {explain(exc)}") from exc

    async def unload_model(self) -> str | None:
        return await self.engine.unload()

    # ---- server -----------------------------------------------------------------------------------------
    def server_facts(self) -> ServerFacts:
        return ServerFacts(self.host, self.port, self.api_key_required, self.model_name, self.engine.engine_args,
                           self._stats().get("max_model_len"))


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _is_switch(exc: BaseException) -> bool:
    return getattr(exc, "code", None) in ("model_switched", "no_model_loaded", "shutdown")
