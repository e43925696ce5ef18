"""OpenAI response bodies and stream chunks (pure dict builders).

Bodies depend only on the token stream and the request: no timing, no node
names, so router and hybrid responses are byte-identical after normalizing
``id`` and ``created``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.text import TextDelta, ToolCall
from router_plugin.http import sse

CHAT = "chat"
TEXT = "text"


@dataclass(frozen=True)
class ResponseMeta:
    kind: str  # CHAT or TEXT
    id: str
    created: int
    model: str
    system_fingerprint: str | None = None

    def header(self, object_name: str) -> dict[str, Any]:
        head: dict[str, Any] = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
        }
        if self.system_fingerprint is not None:
            head["system_fingerprint"] = self.system_fingerprint
        return head


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: prompt tokens served from a node's prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _stream_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"index": c.index, **c.to_openai()} for c in calls]


def _chat_delta(delta: TextDelta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = _stream_tool_calls(delta.tool_calls)
    return out


def _chunk(meta: ResponseMeta, choice: dict[str, Any]) -> dict[str, Any]:
    if meta.kind == CHAT:
        return {**meta.header("chat.completion.chunk"), "choices": [choice]}
    return {**meta.header("text_completion"), "choices": [choice]}


def role_chunk(meta: ResponseMeta) -> dict[str, Any]:
    """The first chat chunk announces the role (what OpenAI sends)."""
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return _chunk(meta, choice)


def delta_chunk(
    meta: ResponseMeta, delta: TextDelta | None, finish_reason: str | None = None
) -> dict[str, Any]:
    if meta.kind == CHAT:
        body = _chat_delta(delta) if delta else {}
        return _chunk(
            meta, {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
        )
    text = delta.content if delta else ""
    return _chunk(
        meta, {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    )


class DeltaEvents:
    """One response's delta events, byte for byte ``sse.event(delta_chunk(meta, delta))``.

    Everything around the delta is the same for the whole response, so it is
    serialized once; per token only the delta itself goes through ``json``.
    """

    _SLOT = "\x00delta\x00"

    def __init__(self, meta: ResponseMeta):
        self._chat = meta.kind == CHAT
        key = "delta" if self._chat else "text"
        chunk = _chunk(meta, {"index": 0, key: self._SLOT, "logprobs": None, "finish_reason": None})
        head, tail = sse.dumps(chunk).split(sse.dumps(self._SLOT))
        self._head, self._tail = f"data: {head}", f"{tail}\n\n"

    def render(self, delta: TextDelta) -> bytes:
        if delta.reasoning or delta.tool_calls or not delta.content:
            value = _chat_delta(delta) if self._chat else delta.content
            return f"{self._head}{sse.dumps(value)}{self._tail}".encode()
        # Plain content, the common case: the string is all json would encode.
        text = sse.dumps_str(delta.content)
        value = f'{{"content":{text}}}' if self._chat else text
        return f"{self._head}{value}{self._tail}".encode()


def usage_chunk(meta: ResponseMeta, counts: dict[str, int]) -> dict[str, Any]:
    name = "chat.completion.chunk" if meta.kind == CHAT else "text_completion"
    return {**meta.header(name), "choices": [], "usage": counts}


def full_body(
    meta: ResponseMeta, total: TextDelta, finish_reason: str, counts: dict[str, int]
) -> dict[str, Any]:
    if meta.kind == TEXT:
        choice = {"index": 0, "text": total.content, "logprobs": None}
        return {
            **meta.header("text_completion"),
            "choices": [{**choice, "finish_reason": finish_reason}],
            "usage": counts,
        }
    message: dict[str, Any] = {
        "role": "assistant",
        "content": total.content if total.content or not total.tool_calls else None,
        "reasoning_content": total.reasoning or None,
    }
    if total.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in total.tool_calls]
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return {**meta.header("chat.completion"), "choices": [choice], "usage": counts}


def accumulate(total: TextDelta, delta: TextDelta) -> None:
    total.content += delta.content
    total.reasoning += delta.reasoning
    total.tool_calls.extend(delta.tool_calls)
