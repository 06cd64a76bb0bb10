"""Grammar-constrained decoding: what a request constrains its output to, and the per-request matcher state.

The grammars are llguidance's (a Rust Earley parser over a lexer, built lazily, so a JSON schema "compiles" in
about a millisecond and the token mask of one step costs tens of microseconds). The matchers live in the
engine's grammar process (engine/grammar_worker.py), which owns the tokenizer's llguidance view (about a second
to build, so the process starts on the first constrained request) and an LRU of compiled grammars: a grammar
seen before is a ``deep_copy`` of its cached matcher, so the ``n`` samples of a request and repeated schemas
compile once.

``StructuredOutputManager`` keeps one matcher slot per constrained sample. Each step a ``GrammarStep`` is posted
to the process, which advances the matchers by the previous step's tokens and writes the constrained rows' token
masks into the shared buffer while the engine's thread queues the forward and the sampling and does the previous
step's text; the sampler applies them. A grammar that is complete ends its request (its mask then allows only
EOS). Preemption recomputes the KV of tokens the matcher already consumed, so the matcher needs no rollback. A
grammar may start later than the first output token: ``starts_after`` names the text (the end of a reasoning
block) after which it applies.

No torch here: bitmasks are numpy int32 arrays of ``ceil(vocab / 32)`` words per row, bit ``i % 32`` of word
``i // 32`` set when token ``i`` is allowed (llguidance's layout).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from engine.errors import EngineError
from engine.grammar_worker import STATUS_OK, STATUS_REJECTED, GrammarProcess
from engine.reasoning import marker_prefix_length

log = logging.getLogger("pagoda.structured_output")

_TAIL_TOKENS = 8  # output tokens decoded to look for ``starts_after`` (a few tokens longer than any marker)
# Compact JSON (json.dumps' separators, no free whitespace): a small model at temperature 1 otherwise pads with
# newlines until max_tokens cuts the object, and the output no longer parses.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_FLEXIBLE = {"whitespace_flexible": True}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, in vLLM's ``structured_outputs`` terms: exactly one of a JSON
    schema (as JSON text), a regex, a list of choices, a grammar (llguidance Lark, or GBNF as llama.cpp
    writes it) or any JSON object. ``param`` names the request field the constraint came from, for errors."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_flexible: bool = False
    starts_after: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise EngineError(f"{self.param} needs exactly one of json, regex, choice, grammar or json_object "
                              f"(got {', '.join(given) or 'none'})", param=self.param)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise EngineError(f"{self.param}.choice must be a non-empty list of strings", param=self.param)

    @classmethod
    def from_schema(cls, schema, **kwargs) -> StructuredOutputsParams:
        """A JSON schema given as a dict (or JSON text) -> params with the schema as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise EngineError(f"the JSON schema is not valid JSON: {exc}",
                                  param=kwargs.get("param", "structured_outputs")) from None
        return cls(json=json.dumps(schema), **kwargs)  # key order kept: the grammar emits properties in it

    def grammar_source(self) -> str:
        """The llguidance grammar text of this constraint (the compiler's cache key)."""
        import llguidance

        matcher = llguidance.LLMatcher
        options = _JSON_FLEXIBLE if self.whitespace_flexible else _JSON_OPTIONS
        try:
            if self.json is not None:
                return matcher.grammar_from_json_schema(self.json, defaults=options)
            if self.json_object:
                return matcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
            if self.regex is not None:
                return matcher.grammar_from_regex(self.regex)
            if self.choice is not None:
                return llguidance.grammar_from("choice", list(self.choice))
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as exc:
            raise EngineError(f"{self.param}: the grammar cannot be compiled: {exc}", param=self.param) from None


class TokenMasks(NamedTuple):
    """One step's bitmasks, a row for every row of the batch (all ones where no grammar applies), so the sampler
    uploads the array as it is. ``wait``, when given, queues the device's wait for the bits, which the grammar
    process is still writing (engine/stream_gate.py): the sampler calls it before the upload."""

    bitmask: np.ndarray  # [num_rows, ceil(vocab / 32)] int32
    wait: Callable[[], object] | None = None


class GrammarStep:
    """One step's grammar work, posted to the grammar process (engine/grammar_worker.py): advance the matchers
    by the previous step's tokens, then write this step's masks into ``bitmask`` (rows of the shared buffer).
    ``ticket`` is the step's number in the done word (None: nothing was posted); ``finish`` waits for the
    process and, once, turns the consume statuses into ``completed`` (the requests whose grammar the new token
    completed or broke, for the engine to end)."""

    def __init__(self, process: GrammarProcess, ticket: int | None, bitmask: np.ndarray | None,
                 consumed: list[tuple[object, _Constraint]], completed: list):
        self._process, self.ticket, self.bitmask = process, ticket, bitmask  # bitmask None: no row masked
        self._consumed, self.completed = consumed, completed
        self._finished = ticket is None

    @property
    def done_word(self) -> np.ndarray:
        """[1] int32 in shared memory: holds ``ticket`` once the masks are written (the stream gate's word)."""
        return self._process.done_word

    @property
    def shared_region(self) -> tuple[int, int]:
        """(address, bytes) of the shared buffer holding ``bitmask`` and the done word."""
        return self._process.buffer_address_and_size

    def finish(self) -> TokenMasks | None:
        if not self._finished:
            self._finished = True
            try:
                statuses = self._process.wait(self.ticket)
            except BaseException:
                self._process.release_stream(self.ticket)  # a device held for these masks must not wait forever
                raise
            for (request, constraint), status in zip(self._consumed, statuses):
                if status == STATUS_REJECTED:
                    log.warning("request %s: its token was rejected by its grammar; ending it", request.request_id)
                if status != STATUS_OK:
                    constraint.done = True
                    self.completed.append(request)
        return TokenMasks(self.bitmask) if self.bitmask is not None else None


class MarkerGuard:
    """Keeps a grammar's opening marker (``starts_after``, e.g. ``</think>``) at a token boundary.

    The grammar starts with the token after the one that completes the marker, so text that completing token
    carries past the marker would reach no grammar: with SmolLM2's BPE, ``>"`` can end ``</think`` and put a
    stray quote before the JSON. While a grammar waits, its row masks the tokens that would complete the marker
    with text left over. The rows are computed once per marker, for each length of the marker's prefix the
    output may end with (0: tokens holding the whole marker and more); most are all-allowed and skipped.
    """

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer  # engine.tokenizer.Tokenizer
        self._vocab_size = vocab_size
        self._texts: list[str] | None = None
        self._rows: dict[str, list[np.ndarray | None]] = {}

    def row_for(self, marker: str, output_token_ids: list[int]) -> np.ndarray | None:
        """The bitmask row [words] int32 for an output that has not reached ``marker`` yet (None: no token
        needs to be forbidden now)."""
        tail = self._tokenizer.decode(output_token_ids[-_TAIL_TOKENS:], skip_special_tokens=False)
        return self._rows_of(marker)[marker_prefix_length(tail, marker)]

    def _rows_of(self, marker: str) -> list[np.ndarray | None]:
        if marker not in self._rows:
            self._rows[marker] = [self._row(marker, marker[:k]) for k in range(len(marker))]
        return self._rows[marker]

    def _row(self, marker: str, prefix: str) -> np.ndarray | None:
        banned = [i for i, text in enumerate(self._token_texts()) if _leaves_text_past(prefix + text, marker)]
        if not banned:
            return None
        words = (self._vocab_size + 31) // 32
        bits = np.ones(words * 32, dtype=np.uint8)
        bits[banned] = 0
        return np.packbits(bits, bitorder="little").view(np.int32)  # bit i % 32 of word i // 32: token i

    def _token_texts(self) -> list[str]:
        if self._texts is None:
            size = min(self._vocab_size, len(self._tokenizer.hf))
            self._texts = [self._tokenizer.decode([i], skip_special_tokens=False) for i in range(size)]
        return self._texts


def _leaves_text_past(text: str, marker: str) -> bool:
    at = text.find(marker)
    return at >= 0 and at + len(marker) < len(text)


@dataclass
class _Constraint:
    slot: int  # the matcher's key in the grammar process
    starts_after: str | None  # None once the grammar applies
    done: bool = False  # complete (or broken): only EOS may follow


class StructuredOutputManager:
    """The constrained samples of an engine and their matchers in the grammar process (started on the first
    constrained request). Called from the engine's stepping thread only."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], max_rows: int):
        self._tokenizer = tokenizer  # engine.tokenizer.Tokenizer: decodes output tails for ``starts_after``
        self.vocab_size = max(vocab_size, len(tokenizer.hf))
        self._eos_token_ids = tuple(int(t) for t in eos_token_ids if 0 <= t < self.vocab_size)
        self._max_rows = max_rows  # rows of a step (the engine's max_num_seqs)
        self._process: GrammarProcess | None = None
        self._constraints: dict[str, _Constraint] = {}
        self._next_slot = 0
        self.num_compiled = 0  # grammars compiled (not copied from the process's cache)
        self._marker_guard = MarkerGuard(tokenizer, self.vocab_size)

    @property
    def num_requests(self) -> int:
        return len(self._constraints)

    def add(self, request_ids: list[str], params: StructuredOutputsParams) -> None:
        """Compile ``params`` once and give each sample its own matcher. Raises EngineError (nothing added)."""
        source = params.grammar_source()
        process = self._process_or_start()
        slots: list[int] = []
        try:
            for _ in request_ids:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
                self.num_compiled += process.add(slot, source)
                slots.append(slot)
        except EngineError as exc:
            for slot in slots:
                process.free(slot)
            if exc.code in ("grammar_process_died", "grammar_process_timeout"):
                raise
            raise EngineError(f"{params.param}: {exc.message}", param=params.param, code=exc.code) from None
        for request_id, slot in zip(request_ids, slots):
            self._constraints[request_id] = _Constraint(slot, params.starts_after)

    def free(self, request_id: str) -> None:
        constraint = self._constraints.pop(request_id, None)
        if constraint is not None and self._process is not None:
            self._process.free(constraint.slot)

    def close(self) -> None:
        """Stop the grammar process (the engine is released)."""
        if self._process is not None:
            self._process.close()
            self._process = None
        self._constraints.clear()

    def token_masks(self, requests: list) -> TokenMasks | None:
        """The bitmasks of the rows whose grammar applies now (None when no row is constrained)."""
        job = self.step_job([], requests)
        return None if job is None else job.finish()

    def accept(self, request, token_id: int) -> bool:
        """Advance the sample's matcher by its newest token (``token_id``); True when its grammar is complete
        (the request may end). The token that ends ``starts_after`` opens the grammar and is not consumed."""
        assert request.output_token_ids[-1] == token_id
        job = self.step_job([request], [])
        if job is not None:
            job.finish()
        return job is not None and request in job.completed

    def step_job(self, newest: list, to_sample: list) -> GrammarStep | None:
        """A step's grammar work, posted to the grammar process: ``newest`` are the requests whose newest token
        no matcher has seen yet, ``to_sample`` the step's rows. Here (on the stepping thread) the rows are
        picked, the unconstrained rows of the bitmask set to all ones and the marker guards written; a grammar
        still waiting for ``starts_after`` is advanced here (it decodes text). None when there is nothing to do."""
        completed, consumed, consumes = [], [], []
        for request in newest:
            constraint = self._constraints.get(request.request_id)
            if constraint is None:
                continue
            if constraint.starts_after is not None:
                self._open_after_marker(request, constraint)
            elif constraint.done:
                completed.append(request)
            else:
                consumed.append((request, constraint))
                consumes.append((constraint.slot, int(request.output_token_ids[-1])))
        masks, guards = [], {}
        for i, request in enumerate(to_sample):
            constraint = self._constraints.get(request.request_id)
            if constraint is None:
                continue
            if constraint.starts_after is None:
                masks.append((i, constraint.slot))
                continue
            guard = self._marker_guard.row_for(constraint.starts_after, request.output_token_ids)
            if guard is not None:
                guards[i] = guard
        if not (consumes or masks or guards or completed):
            return None
        bitmask = None
        if masks or guards:
            bitmask = self._process_or_start().shared.bitmask[:len(to_sample)]  # [rows, words] int32
            bitmask.fill(-1)
            for i, guard in guards.items():
                bitmask[i] = guard
        ticket = self._process.post(consumes, masks) if consumes or masks else None
        return GrammarStep(self._process, ticket, bitmask, consumed, completed)

    def _open_after_marker(self, request, constraint: _Constraint) -> None:
        tail = self._tokenizer.decode(request.output_token_ids[-_TAIL_TOKENS:], skip_special_tokens=False)
        if constraint.starts_after in tail:
            constraint.starts_after = None

    def _process_or_start(self) -> GrammarProcess:
        """The grammar process, started (again, if it died: the matchers it held are gone, so a step with one
        of them fails, which ends those requests) when needed."""
        if self._process is not None and not self._process.alive:
            log.warning("the grammar process died; starting a new one")
            self._process.close()
            self._process = None
        if self._process is None:
            self._process = GrammarProcess(_tokenizer_json(self._tokenizer.hf), self.vocab_size,
                                           self._eos_token_ids, self._max_rows)
        return self._process


def _tokenizer_json(hf_tokenizer) -> str:
    """The Rust tokenizer serialized as llguidance reads it (added tokens included; padding and truncation off)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise EngineError("structured outputs need a fast (tokenizer.json) tokenizer; this model's is not",
                          code="structured_outputs_unsupported")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()
