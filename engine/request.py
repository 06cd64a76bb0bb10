"""Requests and their outputs: SamplingParams, Request (vLLM v1 counter model), RequestOutput."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.structured_output import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Mirrors vLLM's SamplingParams field names."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.n >= 1, "n", "n must be at least 1"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (self.temperature >= 0.0, "temperature", "temperature must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be -1 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "repetition_penalty must be positive"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "logprobs must be in [0, 20]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise EngineError(message, param=param)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """One sequence being generated. ``n > 1`` samples are separate Requests sharing a ``parent_id``.

    The counter model (vLLM v1): ``all_token_ids`` = prompt + generated; the scheduler only ever asks to
    compute tokens ``num_computed_tokens .. num_tokens``. Prefill, chunked prefill, prefix-cache hits,
    recompute after preemption and decode are all that one operation.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    parent_id: str | None = None
    sample_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None


@dataclass
class Logprob:
    token_id: int
    logprob: float
    decoded: str = ""


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request; ``text``/``token_ids`` are cumulative (or deltas when streaming)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: {token_id: Logprob} incl. the chosen one


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
