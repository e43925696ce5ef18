"""Tool-call bodies (the text between tool markup) → OpenAI ``tool_calls``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call_id(index: int, name: str, arguments: str) -> str:
    # Derived from the content, not random: router and hybrid bodies must match.
    digest = hashlib.sha256(f"{index}\0{name}\0{arguments}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def parse_tool_call(body: str, index: int) -> ToolCall | None:
    """Parse ``{"name": ..., "arguments": {...}}``; None when the body is not a call."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if isinstance(data, list) and len(data) == 1:
        data = data[0]  # Mistral-style [TOOL_CALLS][{...}]
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    return tool_call(index, data["name"], data.get("arguments", data.get("parameters", {})))


def tool_call(index: int, name: str, args: Any) -> ToolCall:
    """A call with its arguments as JSON text (text arguments are kept as they came)."""
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(index, _call_id(index, name, arguments), name, arguments)
