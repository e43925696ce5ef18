"""A message's content blocks and Anthropic's stream events, built from the chat deltas.

``MessageEvents`` is fed the same ``TextDelta`` values a chat completion
streams: reasoning becomes a ``thinking`` block, answer text a ``text`` block,
each parsed tool call a ``tool_use`` block (its arguments as one
``input_json_delta``). Events as Anthropic sends them: ``message_start``,
``ping``, per block ``content_block_start`` → ``content_block_delta`` … →
``content_block_stop``, then ``message_delta`` (``stop_reason``, usage) and
``message_stop``. A plain response discards the events and returns ``body``.

Usage: Anthropic counts ``input_tokens`` *besides* the cached ones, so
``input_tokens`` is the prompt minus ``cache_read_input_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

from mlxcel_plugin.engine_api import FINISH_LENGTH, FINISH_STOP
from mlxcel_plugin.text import FINISH_TOOL_CALLS, TextDelta, ToolCall
from router_plugin.http import sse
from router_plugin.http.agent_bridge import delta_parts

THINKING, TEXT = "thinking", "text"
_DELTA = {THINKING: "thinking_delta", TEXT: "text_delta"}


def stop_fields(finish_reason: str | None, stop_sequence: str | None) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` (the ``stop_sequences`` entry that matched)."""
    if finish_reason == FINISH_TOOL_CALLS:
        reason = "tool_use"
    elif finish_reason == FINISH_LENGTH:
        reason = "max_tokens"
    elif finish_reason == FINISH_STOP and stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_sequence}
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": None}


def usage_body(prompt: int, generated: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt - cached, "output_tokens": generated,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}  # fmt: skip


def sse_event(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {sse.dumps(event)}\n\n".encode()


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {"arguments": call.arguments}  # the model wrote no JSON: kept as text
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


class MessageEvents:
    """One message: its content blocks so far and the events that announce them."""

    def __init__(self, head: dict[str, Any]):
        self.head = head  # id, type, role, model
        self.content: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def body(self, finish_reason: str | None, stop_sequence: str | None,
             usage: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        return {**self.head, "content": self.content,
                **stop_fields(finish_reason, stop_sequence), "usage": usage}  # fmt: skip

    def start(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        message = {**self.head, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage}  # fmt: skip
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def feed(self, delta: TextDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for kind, value in delta_parts(delta):
            if kind == "tool_call":
                events += self._close() + self._tool_call(value)
                continue
            block_kind = THINKING if kind == "reasoning" else TEXT
            if self._open is None or self._open["type"] != block_kind:
                events += self._close() + self._open_block(block_kind)
            self._open[block_kind] += value
            events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                           "delta": {"type": _DELTA[block_kind], block_kind: value}})
        return events

    def finish(self, finish_reason: str | None, stop_sequence: str | None,
               usage: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
        delta = stop_fields(finish_reason, stop_sequence)
        return [*self._close(), {"type": "message_delta", "delta": delta, "usage": usage},
                {"type": "message_stop"}]  # fmt: skip

    def _open_block(self, kind: str) -> list[dict[str, Any]]:
        block = {"type": kind, kind: ""}
        if kind == THINKING:
            block["signature"] = ""
        self.content.append(block)
        self._open = block
        return [{"type": "content_block_start", "index": len(self.content) - 1,
                 "content_block": dict(block)}]  # fmt: skip

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _tool_call(self, call: ToolCall) -> list[dict[str, Any]]:
        block = _tool_use(call)
        self.content.append(block)
        index = len(self.content) - 1
        partial = json.dumps(block["input"], ensure_ascii=False)
        return [
            {"type": "content_block_start", "index": index,
             "content_block": {**block, "input": {}}},
            {"type": "content_block_delta", "index": index,
             "delta": {"type": "input_json_delta", "partial_json": partial}},
            {"type": "content_block_stop", "index": index},
        ]  # fmt: skip
