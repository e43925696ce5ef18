"""Anthropic Messages request bodies → a chat-completions body (pure; no tokenizer, no I/O).

``system`` (a string or text blocks) leads as the system message; each
message's blocks become chat messages: ``text`` joins the turn's text,
``tool_use`` (assistant) becomes a tool call with its ``input`` as JSON
arguments, ``tool_result`` (user) a ``tool`` message answering its
``tool_use_id``; ``thinking``/``redacted_thinking`` are the model's earlier
thoughts and are dropped. Tools with an ``input_schema`` become function
tools; Anthropic's server tools (``web_search_*``, ``bash_*`` ...) cannot run
here and are skipped. Problems are an ``InvalidRequestError`` naming the
Messages field.
"""

from __future__ import annotations

import json
from typing import Any

from mlxcel_plugin.errors import InvalidRequestError
from router_plugin.http.agent_bridge import joined_text, known_call_ids

RENAMES = {"max_tokens": "max_tokens", "stop": "stop_sequences", "messages": "messages"}
# Accepted and ignored: what current coding-agent clients send.
IGNORED = ("metadata", "thinking", "context_management", "output_config", "service_tier",
           "container", "mcp_servers", "client_metadata", "betas", "cache_control")  # fmt: skip
DROPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
TEXT_BLOCKS = frozenset({"text"})


def field_error(param: str, message: str) -> InvalidRequestError:
    """A 400 naming the Messages field as Anthropic's errors do (``max_tokens: ...``)."""
    return InvalidRequestError(f"{param}: {message}", param=param)


def _text_blocks(value: Any, param: str) -> str:
    """A string, or text blocks joined (``cache_control`` and citations are ignored)."""
    return joined_text(value, param, TEXT_BLOCKS, "{param}.{index}", field_error)


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise field_error(param, "a tool_use block needs a string id and name")
    if not isinstance(block.get("input"), dict):
        raise field_error(f"{param}.input", "expected an object")
    arguments = json.dumps(block["input"], ensure_ascii=False)
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": arguments}}  # fmt: skip


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise field_error(f"{param}.tool_use_id", "expected a string")
    content = block.get("content")
    text = "" if content is None else _text_blocks(content, f"{param}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _blocks(role: str, content: list[Any], param: str) -> list[dict[str, Any]]:
    """One turn's blocks: tool results first (they answer the previous turn), then the text."""
    texts, calls, results = [], [], []
    for index, block in enumerate(content):
        where = f"{param}.{index}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind not in DROPPED_BLOCKS:
            raise field_error(where, f"block type {kind!r} is not supported in a {role} message")
    turn: list[dict[str, Any]] = list(results)
    if texts or calls or not results:
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        turn.append(message)
    return turn


def chat_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise field_error("messages", "expected a non-empty list of messages")
    out = [] if system is None else [{"role": "system", "content": _text_blocks(system, "system")}]
    for index, message in enumerate(messages):
        param = f"messages.{index}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise field_error(f"{param}.role", f"expected 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _blocks(role, content, f"{param}.content")
        else:
            raise field_error(f"{param}.content", "expected a string or a list of content blocks")
    answered = {m["tool_call_id"] for m in out if m["role"] == "tool"}
    unknown = sorted(answered - known_call_ids(out))
    if unknown:
        raise field_error("messages", f"tool_result for unknown tool_use_id {unknown[0]!r} "
                          "(no tool_use block with that id earlier in the conversation)")
    return out


def _tool(tool: Any, param: str) -> dict[str, Any] | None:
    """A client tool as a chat tool; None for a server tool (it has a ``type``)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise field_error(f"{param}.name", "a tool needs a string name")
    if tool.get("type") not in (None, "custom"):
        return None
    schema, description = tool.get("input_schema"), tool.get("description")
    if schema is not None and not isinstance(schema, dict):
        raise field_error(f"{param}.input_schema", "expected a JSON schema object")
    if description is not None and not isinstance(description, str):
        raise field_error(f"{param}.description", "expected a string")
    function = {"name": tool["name"], "parameters": schema or {}}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def chat_tools(value: Any, skip_hosted: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise field_error("tools", "expected a list of tools")
    tools = []
    for index, tool in enumerate(value):
        converted = _tool(tool, f"tools.{index}")
        if converted is None:
            skip_hosted(str(tool.get("type")))
        else:
            tools.append(converted)
    return tools or None


def tool_choice(value: Any) -> str | dict[str, Any] | None:
    """Anthropic's ``tool_choice`` as chat's: ``any`` is "required", ``tool`` a named function."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None:
        return None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise field_error("tool_choice", "expected {'type': 'auto'|'none'|'any'} or "
                      "{'type': 'tool', 'name': ...}")  # fmt: skip


def _check_sampling(body: dict[str, Any]) -> None:
    """Anthropic's ranges where they are narrower than chat's (the chat parser checks types)."""
    temperature, top_k = body.get("temperature"), body.get("top_k")
    if isinstance(temperature, int | float) and not 0 <= temperature <= 1:
        raise field_error("temperature", f"must be between 0 and 1, got {temperature}")
    if isinstance(top_k, int) and top_k < 0:
        raise field_error("top_k", f"must be at least 0, got {top_k}")


def parse_messages_request(body: dict[str, Any], skip_hosted: Any, *,
                           count_only: bool = False) -> dict[str, Any]:  # fmt: skip
    """The chat body for ``body``; ``count_only`` (count_tokens) needs no ``max_tokens``."""
    if not count_only and body.get("max_tokens") is None:
        raise field_error("max_tokens", "Field required")
    _check_sampling(body)
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str)
                                                                 for s in stops)):  # fmt: skip
        raise field_error("stop_sequences", "expected a list of strings")
    chat = {
        "model": body.get("model"),
        "messages": chat_messages(body.get("system"), body.get("messages")),
        "tools": chat_tools(body.get("tools"), skip_hosted),
        "tool_choice": tool_choice(body.get("tool_choice")),
        "stop": stops,
        **{k: body[k] for k in ("temperature", "top_p", "top_k") if k in body},
    }
    if not count_only:
        chat["max_tokens"] = body["max_tokens"]
    return chat
