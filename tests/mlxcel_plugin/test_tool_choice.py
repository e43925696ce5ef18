"""Forced tool choice → a grammar that admits exactly one call to an allowed tool."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from mlxcel_plugin.errors import InvalidRequestError
from mlxcel_plugin.structured_output import GrammarSpec
from mlxcel_plugin.text.tool_parsers import OURS_PARSER, ToolParser
from mlxcel_plugin.tool_choice import forced_tool_names, tool_call_grammar

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time"}}]  # fmt: skip


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_which_tools_a_choice_forces() -> None:
    assert forced_tool_names(None, TOOLS) is None
    assert forced_tool_names("auto", TOOLS) is None
    assert forced_tool_names("none", TOOLS) is None
    assert forced_tool_names("required", TOOLS) == ("get_weather", "get_time")
    assert forced_tool_names(named("get_time"), TOOLS) == ("get_time",)


@pytest.mark.parametrize("choice", ["always", named("nope"), {"type": "function"}, 3])
def test_a_bad_choice_is_a_400(choice) -> None:
    with pytest.raises(InvalidRequestError) as err:
        forced_tool_names(choice, TOOLS)
    assert err.value.param == "tool_choice"


def test_required_without_tools_is_a_400() -> None:
    with pytest.raises(InvalidRequestError, match="needs 'tools'"):
        forced_tool_names("required", None)


def test_a_family_without_json_calls_cannot_be_forced() -> None:
    pythonic = ToolParser("pythonic", "[", "]", parse=lambda text, tools: None)
    with pytest.raises(InvalidRequestError, match="cannot be forced"):
        tool_call_grammar(("get_time",), TOOLS, pythonic)


@pytest.fixture(scope="module")
def matcher_for(tokenizer_dir):
    text = (Path(tokenizer_dir) / "tokenizer.json").read_text()
    tokenizer = llguidance.LLTokenizer(text, eos_token=2)

    def make(spec_text: str) -> llguidance.LLMatcher:
        spec = GrammarSpec.from_text(spec_text)  # as a decode node reads it off the link
        return llguidance.LLMatcher(tokenizer, spec.llguidance_grammar(), log_level=0)

    return tokenizer, make


def accepts(matcher_for, spec_text: str, output: str) -> bool:
    tokenizer, make = matcher_for
    matcher = make(spec_text)
    return matcher.consume_tokens(tokenizer.tokenize_str(output)) and matcher.is_accepting()


def call(name: str, arguments: dict) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>\n{body}\n</tool_call>"


def test_the_grammar_admits_a_call_to_an_allowed_tool_only(matcher_for) -> None:
    required = tool_call_grammar(("get_weather", "get_time"), TOOLS, OURS_PARSER)
    assert accepts(matcher_for, required, call("get_weather", {"city": "Paris"}))
    assert accepts(matcher_for, required, call("get_time", {}))
    assert not accepts(matcher_for, required, call("get_weather", {"town": "Paris"}))
    assert not accepts(matcher_for, required, call("get_news", {}))
    assert not accepts(matcher_for, required, "It is sunny.")
    only_time = tool_call_grammar(("get_time",), TOOLS, OURS_PARSER)
    assert not accepts(matcher_for, only_time, call("get_weather", {"city": "Paris"}))
    assert accepts(matcher_for, only_time, call("get_time", {}))
