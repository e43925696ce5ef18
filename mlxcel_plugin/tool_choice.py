"""Forced tool choice: ``tool_choice`` "required" or a named function → a grammar spec.

Chat completions' ``tool_choice`` (the Responses and Messages APIs translate
theirs into it): "required" makes the model call one of ``tools``, a named
function makes it call that one. Both are enforced on the grammar engine
(``structured_output.py``): the output must be exactly one call in the model's
own tool-call markup, ``<open>{"name": ..., "arguments": {...}}<close>``, the
arguments under the tool's ``parameters`` schema, then EOS. Only families whose
call body is that JSON can be forced (ours and mlx-lm's ``json_tools``, i.e.
Hermes/Qwen-style ``<tool_call>``); another family's model gets a 400.
"""

from __future__ import annotations

from typing import Any

import llguidance

from mlxcel_plugin.errors import InvalidRequestError
from mlxcel_plugin.structured_output import MAX_GRAMMAR_CHARS, GrammarSpec
from mlxcel_plugin.text.tool_parsers import OURS, ToolParser

PARAM = "tool_choice"
JSON_CALL_PARSERS = frozenset({OURS, "json_tools"})
NOT_FORCED = ("auto", "none")


def forced_tool_names(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, ...] | None:
    """The tools one of which must be called; None when the model may answer freely.

    ``choice``: "auto", "none", "required" or ``{"type": "function", "function":
    {"name": ...}}`` (chat completions' shape); anything else is a 400.
    """
    if choice is None or choice in NOT_FORCED:
        return None
    names = tuple(t["function"]["name"] for t in tools or ())
    if choice == "required":
        if not names:
            raise _bad("'required' needs 'tools'")
        return names
    name = _named(choice)
    if name not in names:
        raise _bad(f"the function {name!r:.80} is not in 'tools'")
    return (name,)


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if (not isinstance(choice, dict) or choice.get("type") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
        raise _bad("expected 'auto', 'none', 'required' or "
                   "{'type': 'function', 'function': {'name': ...}}")  # fmt: skip
    return function["name"]


def tool_call_grammar(names: tuple[str, ...], tools: list[dict[str, Any]],
                      parser: ToolParser) -> str:  # fmt: skip
    """The spec text (``SamplingParams.grammar``) forcing one call to one of ``names``."""
    if parser.name not in JSON_CALL_PARSERS or parser.end is None:
        raise _bad(f"this model's tool-call format ({parser.name}) cannot be forced; "
                   "use 'auto'")  # fmt: skip
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    calls = {name: _arguments_schema(by_name[name].get("parameters")) for name in names}
    spec = GrammarSpec("tool_call", {"calls": calls}, name=PARAM,
                       wrap=(f"{parser.start}\n", f"\n{parser.end}"))  # fmt: skip
    text = spec.to_text()
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _bad(f"the tools' schemas are {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
    _check(spec)
    return text


def _arguments_schema(parameters: Any) -> dict[str, Any]:
    # No (or an empty) ``parameters``: any JSON object, as the chat template shows the tool.
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


def _check(spec: GrammarSpec) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        spec.llguidance_grammar()
    )
    if is_error:
        raise _bad(f"the tools' schemas cannot be enforced: {messages[0] if messages else ''}")


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{PARAM}': {message}", param=PARAM)
