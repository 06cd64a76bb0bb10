"""Reasoning content: the ``<think>...</think>`` block a thinking model writes before its answer, split off.

A model thinks when its chat template knows the end marker (Qwen3, DeepSeek-R1 distills, QwQ). Its output may
start inside the block, when the template opens ``<think>`` at the end of the prompt (forced thinking), or open
the block itself. ``ReasoningSplitter`` follows one output, streamed or whole, and says which text is reasoning
and which is the answer; grammars (structured outputs, tool calls) start after the end marker
(``starts_after``), so the thinking is free and the answer constrained.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


def template_thinks(chat_template: str | None) -> bool:
    return THINK_END in (chat_template or "")


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """The prompt ends inside a think block (the template forced ``<think>``)."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


def prompt_closes_reasoning(prompt_tail: str) -> bool:
    """The prompt ends right after a closed, empty think block (thinking switched off by the template)."""
    return prompt_tail.rstrip().endswith(THINK_END)


@dataclass
class ReasoningSplitter:
    """Splits one output's text into (reasoning, content) deltas as it arrives.

    ``in_reasoning``: the output starts inside the block. Otherwise a block may open at the very start of the
    output (after whitespace); text that could still become ``<think>`` or ``</think>`` is held back.
    """

    in_reasoning: bool = False
    _buffer: str = ""
    _decided: bool = False  # past the point where a block could open
    _done: bool = False  # the block closed (or never opened): everything else is content

    def __post_init__(self) -> None:
        self._decided = self.in_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) released by ``text``."""
        if self._done:
            return "", text
        self._buffer += text
        if not self._decided:
            head = self._buffer.lstrip()
            if THINK_START.startswith(head):
                return "", ""  # still may be the opening marker
            if head.startswith(THINK_START):
                self._buffer, self.in_reasoning = head[len(THINK_START):], True
            self._decided = True
            if not self.in_reasoning:
                self._done = True
                out, self._buffer = self._buffer, ""
                return "", out
        end = self._buffer.find(THINK_END)
        if end >= 0:
            reasoning, content = self._buffer[:end], self._buffer[end + len(THINK_END):].lstrip("\n")
            self._buffer, self._done = "", True
            return reasoning, content
        keep = marker_prefix_length(self._buffer, THINK_END)
        reasoning, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """The output ended: what is held goes out (reasoning if the block never closed)."""
        held, self._buffer = self._buffer, ""
        if self.in_reasoning and not self._done:
            return held, ""
        return "", held

    @property
    def had_reasoning(self) -> bool:
        return self.in_reasoning

    @property
    def thinking(self) -> bool:
        """Inside the think block now: it opened and has not closed (a UI shows its reasoning as in progress)."""
        return self.in_reasoning and not self._done


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    splitter = ReasoningSplitter(in_reasoning)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.had_reasoning else None), content + more_content


def marker_prefix_length(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (shorter than the marker): the text a stream
    holds back because the next piece may complete the marker."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
