"""Grammar-constrained decoding: what a request constrains its output to, and the per-request matcher state.

The grammars are llguidance's (a Rust Earley parser over a lexer, built lazily, so a JSON schema "compiles" in
about a millisecond and the token mask of one step costs tens of microseconds). One ``GrammarCompiler`` per
engine owns the tokenizer's llguidance view (about a second to build, so it is built on the first constrained
request) and an LRU of compiled grammars: a grammar seen before is a ``deep_copy`` of its cached matcher, so
the ``n`` samples of a request and repeated schemas compile once.

``StructuredOutputManager`` keeps one matcher per running sample. Each step, a ``GrammarStep`` advances the
matchers by the previous step's tokens and fills the token bitmask of the constrained rows (all rows at once,
on the engine's mask thread while the engine's thread queues the forward and does the previous step's text);
the sampler applies it. A grammar that is complete ends its request (the mask then allows only EOS).
Preemption recomputes the KV of tokens the matcher already consumed, so the matcher needs no rollback. A grammar may start later than the first output
token: ``starts_after`` names the text (the end of a reasoning block) after which it applies.

No torch here: bitmasks are numpy int32 arrays of ``ceil(vocab / 32)`` words per row, bit ``i % 32`` of word
``i // 32`` set when token ``i`` is allowed (llguidance's layout).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from engine.errors import EngineError
from engine.reasoning import marker_prefix_length

log = logging.getLogger("pagoda.structured_output")

GRAMMAR_CACHE_SIZE = 128
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


class GrammarCompiler:
    """Compiles constraints to matchers for one tokenizer and vocabulary; each grammar once (LRU cache)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        self._eos_token_ids = [int(t) for t in eos_token_ids] or None
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size

    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (every token's bytes), built on first use (about a second)."""
        if self._ll_tokenizer is None:
            import llguidance.hf

            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self._eos_token_ids)
            except Exception as exc:  # noqa: BLE001 -- a slow tokenizer or one llguidance cannot read
                raise EngineError(f"structured outputs are not available for this model's tokenizer: {exc}",
                                  code="structured_outputs_unsupported") from None
        return self._ll_tokenizer

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for ``params`` at its start; EngineError naming ``params.param`` when the grammar is
        invalid (a bad regex, an unsupported schema keyword, a grammar that does not parse)."""
        import llguidance

        source = params.grammar_source()
        template = self._cache.get(source)
        if template is None:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self.ll_tokenizer)
            if is_error:
                raise EngineError(f"{params.param}: the grammar cannot be compiled: {_first_line(messages)}",
                                  param=params.param)
            template = llguidance.LLMatcher(self.ll_tokenizer, source, log_level=0)
            if template.is_error():
                raise EngineError(f"{params.param}: the grammar cannot be compiled: "
                                  f"{_first_line([template.get_error()])}", param=params.param)
            self._cache[source] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(source)
        return template.deep_copy()


def _first_line(messages: list[str]) -> str:
    text = " ".join(messages).strip()
    return text.splitlines()[0] if text else "unknown error"


class TokenMasks(NamedTuple):
    """One step's bitmasks, a row for every row of the batch (all ones where no grammar applies), so the sampler
    uploads the array as it is. ``wait``, when given, queues the device's wait for the bits, which another
    thread is still writing (engine/stream_gate.py): the sampler calls it before the upload."""

    bitmask: np.ndarray  # [num_rows, ceil(vocab / 32)] int32
    wait: Callable[[], object] | None = None


HostArray = Callable[[tuple[int, int]], np.ndarray]  # (rows, words) -> an uninitialised int32 array


def _numpy_int32(shape: tuple[int, int]) -> np.ndarray:
    return np.empty(shape, dtype=np.int32)


class GrammarStep:
    """One step's grammar work: advance the live matchers by the previous step's tokens (one call for the whole
    batch), then fill the bitmasks of this step's rows (another). Both are llguidance calls that release the
    GIL, so on the mask thread they run while the engine's thread queues the forward and does the previous
    step's text. The step holds the matchers it touches (a request freed meanwhile does not matter) and touches
    nothing else of the manager; ``completed`` (read once ``run`` returned) lists the requests whose grammar the
    new token completed, for the engine to end."""

    def __init__(self, executor, consume: list[tuple[object, _Constraint, int]], bitmask: np.ndarray | None,
                 masked: list[tuple[_Constraint, int]], completed: list, eos_token_ids: list[int]):
        self._executor, self._consume, self._bitmask = executor, consume, bitmask  # bitmask None: no row masked
        self._masked, self._eos_token_ids = masked, eos_token_ids  # masked: (constraint, row k of bitmask)
        self.completed = completed

    @property
    def bitmask(self) -> np.ndarray | None:
        """The array ``run`` fills (None: no row is masked this step)."""
        return self._bitmask

    @property
    def num_rows(self) -> int:
        """Matchers this step advances or masks (what decides whether the thread hand-off pays)."""
        return max(len(self._consume), len(self._masked))

    def run(self) -> TokenMasks | None:
        self._advance()
        live = []
        for constraint, k in self._masked:
            if constraint.done:
                allow_only(self._bitmask[k], self._eos_token_ids)
            else:
                live.append((constraint.matcher, k))
        if live:
            rows, words = self._bitmask.shape
            self._executor.unsafe_compute_mask_ptr(live, self._bitmask.ctypes.data, words * 4, rows)
        return TokenMasks(self._bitmask) if self._bitmask is not None else None

    def _advance(self) -> None:
        if len(self._consume) == 1:  # one matcher: the executor's hand-off costs more than the call
            _, constraint, token = self._consume[0]
            accepted = [constraint.matcher.consume_token(token)]
        elif self._consume:
            accepted = self._executor.consume_token_par([(c.matcher, token) for _, c, token in self._consume])
        else:
            return
        for (request, constraint, token), ok in zip(self._consume, accepted):
            after_consume(request, constraint, ok, token)
            if constraint.done:
                self.completed.append(request)


def after_consume(request, constraint: _Constraint, ok: bool, token_id: int) -> None:
    """Mark a constraint done when its matcher rejected the token (the request ends) or is complete."""
    if not ok:
        log.warning("request %s: token %d rejected by its grammar (%s); ending it", request.request_id,
                    token_id, constraint.matcher.get_error())
        constraint.done = True
    elif constraint.matcher.is_stopped():
        constraint.done = True


def allow_only(row: np.ndarray, token_ids: list[int]) -> None:
    """Set ``row``'s bitmask to allow exactly ``token_ids``."""
    row[:] = 0
    for token_id in token_ids:
        row[token_id // 32] |= np.int32(np.uint32(1 << (token_id % 32)).view(np.int32))


@dataclass
class _Constraint:
    matcher: object
    starts_after: str | None  # None once the grammar applies
    done: bool = False  # complete (or broken): only EOS may follow


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


class StructuredOutputManager:
    """The matchers of an engine's constrained samples. Called from the engine's stepping thread only."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], num_threads: int | None = None):
        self._tokenizer = tokenizer  # engine.tokenizer.Tokenizer: decodes output tails for ``starts_after``
        self.compiler = GrammarCompiler(tokenizer.hf, vocab_size, eos_token_ids)
        self._eos_token_ids = [t for t in eos_token_ids if 0 <= t < self.compiler.vocab_size]
        # One llguidance thread: at 32 rows of a nested JSON schema on a 16-core host, 1 thread masked in 323 us
        # and consumed in 224 us, 4 threads in 396 / 366 us, 15 in 625 / 596 us (the pool's hand-off costs more
        # than the rows' work); the step's grammar work runs beside the engine's thread anyway.
        self._num_threads = num_threads or 1
        self._executor = None
        self._constraints: dict[str, _Constraint] = {}
        self._marker_guard = MarkerGuard(tokenizer, self.compiler.vocab_size)

    @property
    def num_requests(self) -> int:
        return len(self._constraints)

    def add(self, request_ids: list[str], params: StructuredOutputsParams) -> None:
        """Compile ``params`` once and give each sample its own matcher. Raises EngineError (nothing added)."""
        matchers = [self.compiler.matcher(params) for _ in request_ids]
        for request_id, matcher in zip(request_ids, matchers):
            self._constraints[request_id] = _Constraint(matcher, params.starts_after)

    def free(self, request_id: str) -> None:
        self._constraints.pop(request_id, None)

    def token_masks(self, requests: list) -> TokenMasks | None:
        """The bitmasks of the rows whose grammar applies now (None when no row is constrained)."""
        job = self.step_job([], requests)
        return None if job is None else job.run()

    def step_job(self, newest: list, to_sample: list, host_array: HostArray | None = None) -> GrammarStep | None:
        """A step's grammar work: ``newest`` are the requests whose newest token no matcher has seen yet,
        ``to_sample`` the step's rows. Picked here (on the stepping thread): the matchers to advance, the rows
        to mask and their matchers; a grammar still waiting for ``starts_after`` is advanced here (it decodes
        text). ``GrammarStep.run`` does the llguidance calls. None when there is nothing to do.
        ``host_array((rows, words))`` allocates the bitmask (the runner gives pinned memory on a GPU, so the
        sampler's upload needs no staging copy; numpy memory by default)."""
        completed, consume = [], []
        for request in newest:
            constraint = self._constraints.get(request.request_id)
            if constraint is None:
                continue
            if constraint.starts_after is not None or constraint.done:
                if self.accept(request, request.output_token_ids[-1]):
                    completed.append(request)
            else:
                consume.append((request, constraint, int(request.output_token_ids[-1])))
        bitmask, masked = self._rows_to_mask(to_sample, host_array or _numpy_int32)
        if not (consume or completed) and bitmask is None:
            return None
        executor = self._executor_or_new() if consume or masked else None
        return GrammarStep(executor, consume, bitmask, masked, completed, self._eos_token_ids)

    def _rows_to_mask(self, requests: list, host_array: HostArray
                      ) -> tuple[np.ndarray | None, list[tuple[_Constraint, int]]]:
        """When a row of ``requests`` is constrained (its grammar or its marker guard applies): a bitmask of the
        whole batch ([rows, words] int32: all ones for the unconstrained rows, guard rows filled) and the
        (constraint, row) pairs still to compute. (None, []) otherwise."""
        guards, masked = {}, []
        for i, request in enumerate(requests):
            constraint = self._constraints.get(request.request_id)
            if constraint is None:
                continue
            if constraint.starts_after is None:
                masked.append((constraint, i))
                continue
            guard = self._marker_guard.row_for(constraint.starts_after, request.output_token_ids)
            if guard is not None:
                guards[i] = guard
        if not (masked or guards):
            return None, []
        words = (self.compiler.vocab_size + 31) // 32
        bitmask = host_array((len(requests), words))  # [rows, words] int32
        bitmask.fill(-1)
        for i, guard in guards.items():
            bitmask[i] = guard
        return bitmask, masked

    def accept(self, request, token_id: int) -> bool:
        """Advance the sample's matcher by its new token; True when its grammar is complete (the request may
        end). The token that ends ``starts_after`` opens the grammar and is not consumed by it."""
        constraint = self._constraints.get(request.request_id)
        if constraint is None:
            return False
        if constraint.starts_after is not None:
            tail = self._tokenizer.decode(request.output_token_ids[-_TAIL_TOKENS:], skip_special_tokens=False)
            if constraint.starts_after in tail:
                constraint.starts_after = None
            return False
        if constraint.done:
            return True
        after_consume(request, constraint, constraint.matcher.consume_token(int(token_id)), token_id)
        return constraint.done

    def _executor_or_new(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
        return self._executor
