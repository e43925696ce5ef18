"""Stream filter: splits generated text into content, reasoning and tool calls.

``<think>…</think>`` becomes reasoning; tool-call markup (``<tool_call>…
</tool_call>``, or a model's own tool token) is removed and its body routed to
the tool-call channel. A marker split across pieces is held back until the
next piece decides whether it is markup or text, so markup never leaks.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

CONTENT = "content"
REASONING = "reasoning"
TOOL_CALL = "tool_call"
TOOL_CALL_END = "tool_call_end"  # a tool-call body is complete (text is empty)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class Piece:
    kind: str
    text: str = ""


@dataclass(frozen=True)
class FilterMarkers:
    think_open: str = THINK_OPEN
    think_close: str = THINK_CLOSE
    # (open, close) pairs; close None: the call runs to the end of the output.
    tool_pairs: tuple[tuple[str, str | None], ...] = ((TOOL_OPEN, TOOL_CLOSE),)

    def with_tool_openers(self, openers: Sequence[str]) -> FilterMarkers:
        extra = tuple((o, None) for o in openers if o not in dict(self.tool_pairs))
        return FilterMarkers(self.think_open, self.think_close, self.tool_pairs + extra)


@functools.lru_cache(maxsize=32)
def _start_finder(starts: tuple[str, ...]) -> Callable[[str], re.Match[str] | None]:
    """Finds the first character of any marker (one pattern per marker set, not per request)."""
    return re.compile("|".join(map(re.escape, starts)) or "(?!)").search


class StreamFilter:
    def __init__(self, markers: FilterMarkers | None = None, *, start_in_reasoning: bool = False):
        self._m = markers or FilterMarkers()
        self._state = REASONING if start_in_reasoning else CONTENT
        self._tool_close: str | None = None
        self._held = ""
        # The first characters of every marker: text without any of them is plain text.
        markers = [self._m.think_open, self._m.think_close]
        markers += [m for pair in self._m.tool_pairs for m in pair if m]
        self._find_start = _start_finder(tuple(sorted({m[0] for m in markers if m})))

    @property
    def state(self) -> str:
        return self._state

    def feed(self, text: str) -> list[Piece]:
        buffer = self._held + text
        self._held = ""
        if self._find_start(buffer) is None:
            return [Piece(self._state, buffer)] if buffer else []
        pieces: list[Piece] = []
        while buffer:
            found = self._next_marker(buffer)
            if found is None:
                keep = self._partial_suffix_len(buffer)
                self._held = buffer[len(buffer) - keep :]
                self._emit(pieces, buffer[: len(buffer) - keep])
                break
            at, marker = found
            self._emit(pieces, buffer[:at])
            self._switch(pieces, marker)
            buffer = buffer[at + len(marker) :]
        return pieces

    def flush(self) -> list[Piece]:
        """End of output: held text is plain text; an open tool call ends here."""
        pieces: list[Piece] = []
        held, self._held = self._held, ""
        self._emit(pieces, held)
        if self._state == TOOL_CALL:
            pieces.append(Piece(TOOL_CALL_END))
            self._state = CONTENT
        return pieces

    def _markers(self) -> list[str]:
        """Markers that mean something in the current state (others are text)."""
        if self._state == REASONING:
            return [self._m.think_close, self._m.think_open]
        if self._state == TOOL_CALL:
            return [self._tool_close] if self._tool_close else []
        return [self._m.think_open, self._m.think_close] + [o for o, _ in self._m.tool_pairs]

    def _next_marker(self, buffer: str) -> tuple[int, str] | None:
        # Earliest marker wins; at the same position the longer one does.
        hits = [(at, -len(m), m) for m in self._markers() if (at := buffer.find(m)) >= 0]
        if not hits:
            return None
        at, _, marker = min(hits)
        return at, marker

    def _partial_suffix_len(self, buffer: str) -> int:
        markers = self._markers()
        if not markers:
            return 0
        longest = min(len(buffer), max(len(m) for m in markers) - 1)
        for k in range(longest, 0, -1):
            if any(m.startswith(buffer[-k:]) for m in markers):
                return k
        return 0

    def _switch(self, pieces: list[Piece], marker: str) -> None:
        if self._state == TOOL_CALL:
            pieces.append(Piece(TOOL_CALL_END))
            self._state, self._tool_close = CONTENT, None
        elif marker == self._m.think_open:
            self._state = REASONING  # a repeated <think> inside reasoning is dropped
        elif marker == self._m.think_close:
            self._state = CONTENT  # a stray </think> in content is dropped too
        else:
            self._state, self._tool_close = TOOL_CALL, dict(self._m.tool_pairs)[marker]

    def _emit(self, pieces: list[Piece], text: str) -> None:
        if text:
            pieces.append(Piece(self._state, text))


def prompt_opens_reasoning(prompt_text: str, markers: FilterMarkers | None = None) -> bool:
    """Whether the chat template already opened a think block (generation starts inside it)."""
    m = markers or FilterMarkers()
    return prompt_text.rfind(m.think_open) > prompt_text.rfind(m.think_close)
