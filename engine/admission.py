"""One admission path: the checks a request passes before it is queued, for the API, the UI and the offline LLM.

Why one module: the same prompt must get the same answer whichever door it comes through. A prompt is admitted
when it is non-empty, every token id is in the vocabulary and it leaves room for at least one output token
(``num_prompt_tokens < max_model_len``); the sampling parameters' token ids (logit_bias, stop_token_ids) must be in
the vocabulary; a request id must not be in use. Every refusal is an ``EngineError`` whose ``param`` is the field
the caller took the value from ("messages" for a chat, "prompt" for a completion), so the API can name it in its
400 and the UI can say what to change.

The scheduler runs ``check_prompt_length`` too, with ``min_output_tokens=0``: it can compute a prompt that fills
the context exactly (its own capacity rule); callers of the engine always leave room for one token.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from engine.errors import EngineError
from engine.request import SamplingParams


def check_prompt_length(num_tokens: int, max_model_len: int, param: str = "prompt", *,
                        min_output_tokens: int = 1) -> None:
    """Refuse an empty prompt or one that leaves fewer than ``min_output_tokens`` of the context."""
    if num_tokens == 0:
        raise EngineError("the prompt is empty: give at least one token", param=param)
    if num_tokens + min_output_tokens > max_model_len:
        raise EngineError(f"the prompt is {num_tokens} tokens but this model's context is {max_model_len} tokens "
                          "(prompt and output together); shorten it", param=param, code="context_length_exceeded")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        raise EngineError(f"prompt token ids must be integers in [0, {vocab_size})", param=param)


def check_params_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Reject token ids the model does not have, before the request reaches a batch."""
    for token_id in (params.logit_bias or {}):
        if not 0 <= int(token_id) < vocab_size:
            raise EngineError(f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                              param="logit_bias")
    for token_id in params.stop_token_ids or []:
        if not 0 <= int(token_id) < vocab_size:
            raise EngineError(f"stop token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                              param="stop_token_ids")


def check_request_id(request_id: str, in_use: Container[str]) -> None:
    if request_id in in_use:
        raise EngineError(f"request id {request_id!r} is already in use", param="request_id")


@dataclass(frozen=True)
class Admission:
    """The admission rules of one served model (its context length and vocabulary)."""

    max_model_len: int
    vocab_size: int

    def check_prompt(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """Length and vocabulary of a tokenized prompt."""
        check_prompt_length(len(token_ids), self.max_model_len, param)
        check_token_ids(token_ids, self.vocab_size, param)

    def check_params(self, params: SamplingParams) -> None:
        check_params_vocab(params, self.vocab_size)

    def output_room(self, num_prompt_tokens: int) -> int:
        """Tokens the context leaves for the output after the prompt (the cap of ``max_tokens``)."""
        return self.max_model_len - num_prompt_tokens
