"""Token events in, client-visible text deltas out — shared by every front.

Order: detokenize → stop strings (on the raw text, like vLLM) → stream filter
(reasoning / tool calls). The pipeline also decides the ``max_tokens`` budget
and EOS, so a front can close the token stream itself; it is synchronous and
pure. One request's pipeline is held by that request's ``Completion`` on the
front, the only thing that feeds it or reads its finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    TokenEvent,
)
from mlxcel_plugin.text.detokenizer import IncrementalDetokenizer
from mlxcel_plugin.text.stop_strings import StopStringMatcher
from mlxcel_plugin.text.stream_filter import (
    CONTENT,
    REASONING,
    TOOL_CALL,
    TOOL_CALL_END,
    Piece,
    StreamFilter,
)
from mlxcel_plugin.text.tokenizer import TextTokenizer
from mlxcel_plugin.text.tool_calls import ToolCall

FINISH_TOOL_CALLS = "tool_calls"


@dataclass
class TextDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class CompletionPipeline:
    """One request's text state; ``feed`` every event until ``done``."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        stream_filter: StreamFilter | None = None,
        parse_tools: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,  # typing the arguments (mlx-lm parsers)
    ):
        kept = tokenizer.tool_token_ids() if stream_filter is not None else {}
        self._detok = IncrementalDetokenizer(tokenizer.decode, kept, tokenizer.piece)
        self._stops = StopStringMatcher(stop)
        self._filter = stream_filter
        self._parse_tools = parse_tools
        self._tool_parser = tokenizer.tool_parser  # mlx-lm's or ours (tool_parsers.py)
        self._tools = tools
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._max_tokens = max_tokens
        self._tool_body = ""
        self.tool_calls: list[ToolCall] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the output (Anthropic's ``stop_sequence``), if one did."""
        return self._stops.matched

    def feed(self, event: TokenEvent) -> TextDelta:
        if self.done:
            return TextDelta()
        delta = TextDelta()
        if event.token_id is not None:
            self.completion_tokens += 1
            if event.token_id in self._eos:
                return self._finish(delta, FINISH_STOP)
            if self._push(delta, self._detok.add(event.token_id)):
                return self._finish(delta, FINISH_STOP, flush=False)
        if event.finish_reason in (FINISH_CANCELLED, FINISH_ERROR):
            self.error = event.error or f"generation {event.finish_reason}"
            return self._finish(delta, FINISH_ERROR, flush=False)
        if event.finish_reason is not None:
            return self._finish(delta, event.finish_reason)
        if self.completion_tokens >= self._max_tokens:
            return self._finish(delta, FINISH_LENGTH)
        return delta

    def fail(self, message: str) -> None:
        """The token stream broke off (a lost node, a closed link)."""
        if not self.done:
            self.error, self.finish_reason = message, FINISH_ERROR

    def _push(self, delta: TextDelta, text: str) -> bool:
        """Route raw text through stop strings and the filter; True on a stop string."""
        visible, stopped = self._stops.feed(text)
        self._route(delta, self._filtered(visible))
        return stopped

    def _finish(self, delta: TextDelta, reason: str, *, flush: bool = True) -> TextDelta:
        stopped = flush and self._push(delta, self._detok.flush())
        if flush and not stopped:
            self._route(delta, self._filtered(self._stops.flush()))
        if self._filter is not None:
            self._route(delta, self._filter.flush())
        if stopped:
            reason = FINISH_STOP
        if reason == FINISH_STOP and self.tool_calls:
            reason = FINISH_TOOL_CALLS
        self.finish_reason = reason
        return delta

    def _filtered(self, text: str) -> list[Piece]:
        if self._filter is None:
            return [Piece(CONTENT, text)] if text else []
        return self._filter.feed(text)

    def _route(self, delta: TextDelta, pieces: list[Piece]) -> None:
        for piece in pieces:
            if piece.kind == CONTENT:
                delta.content += piece.text
            elif piece.kind == REASONING:
                delta.reasoning += piece.text
            elif piece.kind == TOOL_CALL:
                self._tool_body += piece.text
            elif piece.kind == TOOL_CALL_END:
                self._end_tool_call(delta)

    def _end_tool_call(self, delta: TextDelta) -> None:
        body, self._tool_body = self._tool_body.strip(), ""
        calls = (self._tool_parser.calls(body, len(self.tool_calls), self._tools)
                 if self._parse_tools else None)
        if calls is None:
            delta.content += body  # not a call we can return: its text, without the markup
            return
        self.tool_calls += calls
        delta.tool_calls += calls
