"""What the agent APIs (Responses, Messages) share: one chat request underneath.

Each agent API translates its body into a chat-completions body, and
``plan_translated`` plans that on the front exactly as ``/v1/chat/completions``
does (``parse_chat_request`` then ``OpenAIFront.plan_chat``: chat template,
tools, stream filter, reasoning split, tool parser, grammar, budget). The
``Completion`` it returns yields the same ``TextDelta`` values the chat routes
render; each API renders them in its own shape. Errors the chat parser raises
name the chat field; ``renames`` turns that into the agent API's field name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mlxcel_plugin.errors import InvalidRequestError
from mlxcel_plugin.text import TextDelta
from router_plugin.http.completion import Completion
from router_plugin.http.openai_schema import parse_chat_request

logger = logging.getLogger(__name__)


class IgnoredFields:
    """Fields an agent client sends that this server accepts and ignores, logged once each."""

    def __init__(self, api: str, names: Iterable[str]):
        self.api = api
        self.names = frozenset(names)
        self._logged: set[str] = set()

    def note(self, body: Mapping[str, Any]) -> None:
        for name in self.names.intersection(body).difference(self._logged):
            self._logged.add(name)
            logger.info("%s: field %r accepted and ignored (logged once)", self.api, name)

    def skip_tool(self, kind: str) -> None:
        key = f"tool:{kind}"
        if key not in self._logged:
            self._logged.add(key)
            logger.info("%s: hosted tool type %r cannot run on a local server; skipped "
                        "(logged once)", self.api, kind)  # fmt: skip


def joined_text(value: Any, param: str, kinds: frozenset[str], item_param: str,
                field_error: Callable[[str, str], InvalidRequestError]) -> str:
    """A string, or a list of text parts (``type`` in ``kinds``) joined into one string.

    Each API names its fields its own way: ``item_param`` spells an item's field from
    ``{param}`` and ``{index}`` (Responses ``input[0]``, Messages ``messages.0``), and
    ``field_error`` words the error as that API's clients expect.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise field_error(param, "expected a string or a list of content parts")
    texts = []
    for index, part in enumerate(value):
        where = item_param.format(param=param, index=index)
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise field_error(where, f"content type {kind!r} is not supported here "
                              f"(text only: {', '.join(sorted(kinds))})")  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise field_error(f"{where}.text", "expected a string")
        texts.append(part["text"])
    return "".join(texts)


def renamed(exc: InvalidRequestError, renames: Mapping[str, str]) -> InvalidRequestError:
    """The chat parser's error, naming the agent API's field instead of the chat one."""
    param = exc.param or ""
    head = param.split("[", 1)[0].split(".", 1)[0]
    if head not in renames:
        return exc
    new_param = renames[head] + param[len(head):]
    message = exc.message.replace(f"'{param}'", f"'{new_param}'", 1)
    return type(exc)(message, param=new_param, code=exc.code)


def plan_translated(front: Any, chat_body: dict[str, Any], arrival_s: float, in_thread: bool,
                    renames: Mapping[str, str]) -> Completion:  # fmt: skip
    """``chat_body`` planned as a chat completion on ``front`` (an ``OpenAIFront``)."""
    try:
        params = parse_chat_request(chat_body)
        return front.plan_chat(params, arrival_s, in_thread=in_thread)
    except InvalidRequestError as exc:
        raise renamed(exc, renames) from exc


def count_prompt_tokens(front: Any, chat_body: dict[str, Any],
                        renames: Mapping[str, str]) -> int:  # fmt: skip
    """The prompt tokens ``chat_body`` renders to (its template, its tools), nothing generated."""
    try:
        params = parse_chat_request(chat_body)
    except InvalidRequestError as exc:
        raise renamed(exc, renames) from exc
    tokenizer = front.tokenizer
    text = tokenizer.render_chat(params.messages, tools=params.tools,
                                 template_kwargs=params.template_kwargs)  # fmt: skip
    return len(tokenizer.encode_chat(text))


def known_call_ids(messages: Iterable[Mapping[str, Any]]) -> set[str]:
    """The ids of the tool calls earlier assistant turns made (a result must answer one)."""
    return {call.get("id") for m in messages for call in m.get("tool_calls") or ()}


def usage_counts(completion: Completion) -> tuple[int, int, int]:
    """(prompt tokens, generated tokens, prompt tokens served from a prefix cache)."""
    usage = completion.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens"], usage["completion_tokens"], cached


def delta_parts(delta: TextDelta) -> Iterable[tuple[str, Any]]:
    """A delta as ("reasoning"|"text"|"tool_call", value) in the order the model wrote them.

    The stream filter emits reasoning before the answer, and a tool call ends its delta.
    """
    if delta.reasoning:
        yield "reasoning", delta.reasoning
    if delta.content:
        yield "text", delta.content
    for call in delta.tool_calls:
        yield "tool_call", call
