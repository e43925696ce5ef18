"""Chat messages as a template can take them, and what a template leaves out.

OpenAI clients send an assistant turn that called tools as ``content: null``
plus ``tool_calls``, then ``tool`` turns with the results. A template that
renders ``tool_calls`` gets them as they are (with ``""`` for the null
content, as mlx-lm's server does). One that does not (the embedded SmolLM2's
concatenates ``message['content']``) would fail on the null or drop the
call; it gets the call folded into the content as the ``<tool_call>`` JSON
our parser reads (``tool_calls.py``), so the model sees what it asked for
before the result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.text.stream_filter import TOOL_CLOSE, TOOL_OPEN


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template's source mentions (how mlx-lm tells template families apart)."""

    tools: bool  # renders the request's ``tools``
    tool_calls: bool  # renders an assistant turn's ``tool_calls``

    @classmethod
    def of(cls, template: str) -> TemplateSupport:
        return cls(tools="tools" in template, tool_calls="tool_calls" in template)


def template_messages(
    messages: list[dict[str, Any]], support: TemplateSupport
) -> list[dict[str, Any]]:
    """``messages`` with null contents as "" and, where the template has no place for
    them, tool calls folded into their turn's content."""
    return [_for_template(message, support) for message in messages]


def _for_template(message: dict[str, Any], support: TemplateSupport) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("content") is not None and not (calls and not support.tool_calls):
        return message
    out = dict(message)
    if calls and not support.tool_calls:
        out.pop("tool_calls")
        out["content"] = (message.get("content") or "") + "".join(map(_markup, calls))
    elif out.get("content") is None:
        out["content"] = ""
    return out


def _markup(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return f"{TOOL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CLOSE}"
