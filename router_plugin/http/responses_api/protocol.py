"""OpenAI Responses request bodies → a chat-completions body (pure; no tokenizer, no I/O).

``input`` (a string or items) becomes chat messages: ``message`` items with
``input_text``/``output_text`` parts, ``function_call`` items become an
assistant turn's ``tool_calls``, ``function_call_output`` items ``tool``
messages; ``reasoning`` items are the model's own earlier thoughts and are
dropped (most chat templates drop them too). ``instructions`` leads as the
system message; it is not carried to a continuation (as OpenAI). Function
tools become chat tools; hosted tools (``web_search``, ``file_search``, MCP,
namespaces) cannot run here and are skipped. Problems are an
``InvalidRequestError`` naming the Responses field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlxcel_plugin.errors import InvalidRequestError
from router_plugin.http.agent_bridge import joined_text, known_call_ids

ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text"})
# Chat fields whose errors must name the Responses field instead.
RENAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
           "messages": "input", "tools": "tools", "tool_choice": "tool_choice"}  # fmt: skip
# Accepted and ignored (real agent clients send them; none changes the tokens).
IGNORED = ("include", "parallel_tool_calls", "metadata", "user",
           "safety_identifier", "service_tier", "truncation", "reasoning", "max_tool_calls",
           "top_logprobs", "stream_options", "client_metadata", "context_management",
           "prompt_cache_retention")  # fmt: skip
REFUSED = {"background": "background responses are not supported",
           "conversation": "conversations are not supported; use previous_response_id",
           "prompt": "prompt templates are not supported"}  # fmt: skip


@dataclass
class ResponsesRequest:
    """One ``POST /v1/responses``: the chat body to plan, and what the response echoes."""

    messages: list[dict[str, Any]]  # this turn's input as chat messages (no instructions)
    chat_body: dict[str, Any]  # built once the conversation so far is known
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    instructions: str | None = None


def field_error(param: str, message: str) -> InvalidRequestError:
    """A 400 naming the Responses field, quoted as OpenAI's own errors quote it."""
    return InvalidRequestError(f"'{param}': {message}", param=param)


def _text_of(content: Any, param: str) -> str:
    return joined_text(content, param, TEXT_PARTS, "{param}[{index}]", field_error)


def _message_item(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise field_error(f"{param}.role", f"expected one of {sorted(ROLES)}, got {role!r}")
    return {"role": role, "content": _text_of(item.get("content"), f"{param}.content")}


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise field_error(f"{param}.{name}", "expected a string")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
        last.setdefault("tool_calls", []).append(call)  # one turn: its text and its calls
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise field_error(f"{param}.call_id", "expected a string")
    output = item.get("output")
    text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": text}


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise field_error("input", "expected a string or a non-empty list of items")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise field_error(param, "expected an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message_item(item, param))
        elif kind == "function_call":
            _add_call(messages, _function_call(item, param))
        elif kind == "function_call_output":
            messages.append(_call_output(item, param))
        elif kind != "reasoning":
            raise field_error(f"{param}.type", f"input item type {kind!r} is not supported")
    return messages


def chat_tools(value: Any, skip_hosted: Any) -> list[dict[str, Any]] | None:
    """Function tools as chat tools; ``skip_hosted(type)`` is told of each hosted tool."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise field_error("tools", "expected a list of tools")
    tools = []
    for index, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise field_error(f"tools[{index}].type", "each tool needs a string type")
        name = tool.get("name")
        if (kind == "function" or name is not None) and not isinstance(name, str):
            raise field_error(f"tools[{index}].name",
                              "expected a string (required on a function tool)")
        if kind != "function":
            skip_hosted(kind)
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        tools.append({"type": "function", "function": function})
    return tools or None


def tool_choice(value: Any) -> str | dict[str, Any] | None:
    """Responses' ``tool_choice`` as chat's (``{"type": "function", "name"}`` is flat here)."""
    if value is None or value in ("auto", "none", "required"):
        return value
    if (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(value.get("name"), str)):  # fmt: skip
        return {"type": "function", "function": {"name": value["name"]}}
    raise field_error("tool_choice", "expected 'auto', 'none', 'required' or "
                      "{'type': 'function', 'name': ...}")  # fmt: skip


def response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (the same grammar engine)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise field_error("text", "expected an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise field_error("text.format", "expected an object")
    _check_format_fields(fmt)
    if fmt.get("type") != "json_schema":
        return fmt  # text / json_object: the same shape as chat's
    schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _check_format_fields(fmt: dict[str, Any]) -> None:
    for name, kind, what in (("name", str, "a string"), ("strict", bool, "a boolean"),
                             ("schema", dict, "a JSON schema object")):  # fmt: skip
        if fmt.get(name) is not None and not isinstance(fmt[name], kind):
            raise field_error(f"text.format.{name}", f"expected {what}")


def refuse_unsupported(body: dict[str, Any]) -> None:
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False):
            raise field_error(name, why)


def show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise field_error(name, f"expected a boolean, got {show(value)}")
    return value


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise field_error(name, f"expected a string, got {show(value)}")
    return value


def _echo(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": [{"type": "function", **t["function"]} for t in tools or ()],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": {"format": text.get("format") or {"type": "text"}},
        "metadata": body.get("metadata") or {},
    }


def parse_responses_request(body: dict[str, Any], skip_hosted: Any) -> ResponsesRequest:
    """The body checked and translated; the chat body still lacks earlier turns."""
    refuse_unsupported(body)
    if body.get("input") is None:
        raise field_error("input", "this field is required")
    messages = input_messages(body["input"])
    instructions = _optional_str(body, "instructions")
    tools = chat_tools(body.get("tools"), skip_hosted)
    chat_body = {
        "model": body.get("model"),
        "max_tokens": body.get("max_output_tokens"),
        "tools": tools,
        "tool_choice": tool_choice(body.get("tool_choice")),
        "response_format": response_format(body.get("text")),
        **{k: body[k] for k in ("temperature", "top_p", "seed", "top_k", "prompt_cache_key")
           if k in body},
    }
    return ResponsesRequest(
        messages=messages, chat_body=chat_body, echo=_echo(body, tools),
        stream=_bool(body, "stream", False), store=_bool(body, "store", True),
        previous_response_id=_optional_str(body, "previous_response_id"),
        instructions=instructions,
    )  # fmt: skip


def conversation(request: ResponsesRequest, earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body for this turn: instructions, the stored turns, then this input."""
    lead = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages = [*lead, *earlier, *request.messages]
    answered = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
    unknown = sorted(answered - known_call_ids(messages))
    if unknown:
        raise field_error("input", f"function_call_output for unknown call_id {unknown[0]!r} "
                          "(no function_call with that call_id in this conversation)")  # fmt: skip
    return {**request.chat_body, "messages": messages}
