"""Turn generated token ids into streamed text: UTF-8-safe incremental decoding and stop strings.

Why not decode the whole output each step: that costs O(output length) per token. Why not decode each token
alone: byte-level BPE splits emoji and CJK characters over several tokens (a lone piece decodes to U+FFFD), and
SentencePiece decoders drop the leading space of the first token they see. So, like vLLM's
``prefix_offset``/``read_offset`` scheme, we decode a small window: the tokens already released last time
(``prefix``) plus the new ones, and release the difference between the two decodes. The prefix gives the new
tokens their context (spaces come out right), and while the window's text ends in U+FFFD the character is not
complete, so nothing is released and the window grows until it is. The window starts with a few prompt tokens,
so the first generated token is decoded in context too.

Stop strings: the released text never contains any part of a stop string that may still complete. After
decoding we search the text not yet released for each stop string and otherwise hold back the longest tail
that is a proper prefix of some stop string. A stop string is matched where it first *ends* (as if the text
arrived one character at a time), so the result does not depend on how the text was split into tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the first generated token, for its spacing


def detokenize_full(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The whole text of ``ids`` at once (non-streamed checks; the streamed text must equal it)."""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """The text of one request, released piece by piece as tokens arrive.

    ``add_token``/``add_tokens`` return the newly releasable text; ``flush`` releases what is still held when
    the request ends for another reason (eos, length, abort). ``text`` is all text released so far. When a
    stop string is found, ``stop_string`` names it, the text ends before it (or after it with
    ``include_stop_str_in_output``) and later calls return ''. Stop strings are only looked for in text that
    ends after the first ``min_tokens`` tokens (vLLM semantics: ``min_tokens`` holds off stop strings too).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Iterable[str] = (), include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in dict.fromkeys(stop or ()) if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        # Window state over self._ids (a few prompt tokens, then every generated token).
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_text = self._decode(0, len(self._ids))
        while self._prefix_text.endswith(_REPLACEMENT_CHAR):  # a prompt cut inside a character: the
            self._ids.pop()  # context must end on a whole character, or the first delta would be misaligned
            self._prefix_text = self._decode(0, len(self._ids))
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Text decoded but not released yet: a tail that may still become a stop string.
        self._held = ""
        self._text = ""  # released so far (a str append copies, but only memcpy-fast bytes, never re-decodes)
        self.stop_string: str | None = None
        self.num_output_tokens = 0
        self._flushed = False

    @property
    def finished(self) -> bool:
        """True after a stop string matched or after ``flush``: nothing more will be released."""
        return self.stop_string is not None or self._flushed

    @property
    def text(self) -> str:
        """All text released so far (the final output text once finished)."""
        return self._text

    def add_token(self, token_id: int) -> str:
        """Take one generated token; return the text that can be released now (often '')."""
        if self.finished:
            return ""
        self._ids.append(int(token_id))
        self.num_output_tokens += 1
        return self._release(self._decode_new(final=False), final=False)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Take several tokens at once; same as calling ``add_token`` for each and joining the results."""
        return "".join(self.add_token(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """The request ended for another reason: release everything still held (an incomplete character
        comes out as U+FFFD, exactly as a full decode would show it)."""
        if self.finished:
            return ""
        delta = self._release(self._decode_new(final=True), final=True)
        self._flushed = True
        return delta

    # -- decoding ------------------------------------------------------------------------------------------

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text added by the tokens after ``read_offset``, or '' while it ends in an incomplete character."""
        if self._read_offset == len(self._ids):
            return ""
        window_text = self._decode(self._prefix_offset, len(self._ids))
        if window_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # a multi-byte character is still being spelled out: wait for its last byte
        # The prefix decodes the same inside the longer window (it ends on a character boundary).
        delta = window_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return delta

    # -- stop strings and release -------------------------------------------------------------------------

    def _release(self, delta: str, final: bool) -> str:
        """Append ``delta`` to the held text; release what can no longer be part of a stop string."""
        pending = self._held + delta
        if self._stops and self.num_output_tokens > self._min_tokens:
            match = self._find_stop(pending, new_from=len(self._held))
            if match is not None:
                start, stop = match
                self.stop_string = stop
                return self._emit(pending[:start + len(stop)] if self._include_stop else pending[:start])
        keep = 0 if final else self._stop_prefix_length(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return self._emit(pending[:len(pending) - keep])

    def _emit(self, piece: str) -> str:
        self._text += piece
        if self.stop_string is not None:
            self._held = ""
        return piece

    def _find_stop(self, pending: str, new_from: int) -> tuple[int, str] | None:
        """The stop string occurrence in ``pending`` that ends first among those ending after ``new_from``
        (ties: the longer one). Occurrences cannot start before ``pending``: its start was held back."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = pending.find(stop, max(0, new_from - len(stop) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _stop_prefix_length(self, pending: str) -> int:
        """Length of the longest tail of ``pending`` that is a proper prefix of some stop string."""
        if not self._stops:
            return 0
        longest = min(len(pending), max(len(s) for s in self._stops) - 1)
        for length in range(longest, 0, -1):
            tail = pending[-length:]
            if any(len(s) > length and s.startswith(tail) for s in self._stops):
                return length
        return 0
