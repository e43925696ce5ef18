"""A response's output items and its typed stream events, built from the chat deltas.

``ResponseEvents`` is fed the same ``TextDelta`` values a chat completion
streams. Reasoning becomes a ``reasoning`` item (``reasoning_text`` content),
answer text a ``message`` item (``output_text``), each parsed tool call a
``function_call`` item. A streamed response sends the events as they come; a
plain one discards them and returns ``body``: one builder, so both agree.
Event order as OpenAI's: ``response.created``, ``response.in_progress``, per
item ``output_item.added`` → (``content_part.added`` → deltas → ``.done`` →
``content_part.done``) → ``output_item.done``, then ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut it, ``response.failed``
on an error). Every event carries a ``sequence_number``.
"""

from __future__ import annotations

import uuid
from typing import Any

from mlxcel_plugin.text import TextDelta, ToolCall
from router_plugin.http.agent_bridge import delta_parts

REASONING, MESSAGE = "reasoning", "message"
_PART = {REASONING: "reasoning_text", MESSAGE: "output_text"}
_DELTA = {REASONING: "response.reasoning_text", MESSAGE: "response.output_text"}


def usage_body(prompt: int, generated: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def _new_item(kind: str) -> dict[str, Any]:
    if kind == REASONING:
        return {"id": f"rs_{uuid.uuid4().hex}", "type": REASONING, "summary": [],
                "content": [], "status": "in_progress"}  # fmt: skip
    return {"id": f"msg_{uuid.uuid4().hex}", "type": MESSAGE, "role": "assistant",
            "status": "in_progress", "content": []}  # fmt: skip


def _function_call(call: ToolCall) -> dict[str, Any]:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}  # fmt: skip


def _empty_part(kind: str) -> dict[str, Any]:
    if kind == REASONING:
        return {"type": "reasoning_text", "text": ""}
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


class ResponseEvents:
    """One response: its output so far and the events that announce it."""

    def __init__(self, head: dict[str, Any]):
        self.head = head  # id, object, created_at, model and the echoed request fields
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item still receiving text
        self._sequence = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def body(self, status: str, usage: dict[str, Any] | None = None,
             **extra: Any) -> dict[str, Any]:  # fmt: skip
        fields = {"status": status, "error": None, "incomplete_details": None, **extra}
        return {**self.head, **fields, "output": [dict(i) for i in self.output], "usage": usage}

    def start(self) -> list[dict[str, Any]]:
        response = self.body("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]  # fmt: skip

    def feed(self, delta: TextDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for kind, value in delta_parts(delta):
            if kind == "tool_call":
                events += self._close() + self._call(value)
                continue
            item_kind = REASONING if kind == "reasoning" else MESSAGE
            if self._open is None or self._open["type"] != item_kind:
                events += self._close() + self._open_item(item_kind)
            events += self._text(self._open, value)
        return events

    def finish(self, status: str, usage: dict[str, Any] | None,
               **extra: Any) -> list[dict[str, Any]]:  # fmt: skip
        """The closing events; ``status`` completed, incomplete or failed."""
        events = self._close()
        name = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[status]  # fmt: skip
        return events + [self._event(name, response=self.body(status, usage, **extra))]

    # items

    def _where(self) -> dict[str, Any]:
        item = self._open or {}
        return {"item_id": item.get("id"), "output_index": len(self.output) - 1}

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        item = _new_item(kind)
        self.output.append(item)
        self._open = item
        added = self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item={**item, "content": []})  # fmt: skip
        item["content"].append(_empty_part(kind))
        part = self._event("response.content_part.added", **self._where(), content_index=0,
                           part=_empty_part(kind))  # fmt: skip
        return [added, part]

    def _text(self, item: dict[str, Any], text: str) -> list[dict[str, Any]]:
        item["content"][0]["text"] += text
        extra = {"logprobs": []} if item["type"] == MESSAGE else {}
        kind = _DELTA[item["type"]]
        return [self._event(f"{kind}.delta", **self._where(), content_index=0, delta=text,
                            **extra)]  # fmt: skip

    def _close(self) -> list[dict[str, Any]]:
        item, where = self._open, self._where()
        if item is None:
            return []
        self._open = None
        item["status"] = "completed"
        part = dict(item["content"][0])
        extra = {"logprobs": []} if item["type"] == MESSAGE else {}
        return [
            self._event(f"{_DELTA[item['type']]}.done", **where, content_index=0,
                        text=part["text"], **extra),
            self._event("response.content_part.done", **where, content_index=0, part=part),
            self._event("response.output_item.done", output_index=where["output_index"],
                        item=dict(item)),
        ]  # fmt: skip

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        item = _function_call(call)
        self.output.append(item)
        index = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        return [
            self._event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", **where,
                        delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, name=call.name,
                        arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]  # fmt: skip


def output_as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the assistant turn of a chat (what a continuation resends)."""
    text = "".join(i["content"][0]["text"] for i in output if i["type"] == MESSAGE)
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    elif not text:
        message["content"] = ""
    return [message]
