"""Forced ``tool_choice`` on chat completions, Responses and Messages: the request carries the
grammar that admits one call to an allowed tool, and the model's call comes back parsed.

The scripted engine here checks its reply against the request's grammar (llguidance, the
model's tokenizer) before sending it, as the MLX engine's masks would make it; the MLX
engine itself is driven under the grammar in tests/engines/test_tool_choice_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import llguidance
import pytest

from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.structured_output import GrammarSpec
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app

EOS = 2
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
              {"type": "function", "function": {"name": "get_time"}}]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
MESSAGES_TOOLS = [{"name": "get_weather", "input_schema": CITY}, {"name": "get_time"}]
USER = [{"role": "user", "content": "Say hi"}]
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def front(text_tokenizer, tokenizer_dir, make_engine):
    """(client, requests seen); the engine replies with a call when forced, else plain text."""
    grammar_tokenizer = llguidance.LLTokenizer(
        (Path(tokenizer_dir) / "tokenizer.json").read_text(), eos_token=EOS)
    seen: list[GenerationRequest] = []

    def script(request: GenerationRequest) -> list[int]:
        seen.append(request)
        if request.sampling.grammar is None:
            return text_tokenizer.encode("Hello there.", add_special_tokens=False) + [EOS]
        spec = GrammarSpec.from_text(request.sampling.grammar)
        matcher = llguidance.LLMatcher(grammar_tokenizer, spec.llguidance_grammar())
        call = CALL if "get_weather" in spec.schema["calls"] else TIME_CALL
        tokens = grammar_tokenizer.tokenize_str(call)
        assert matcher.consume_tokens(tokens) and matcher.is_accepting(), matcher.get_error()
        return tokens + [EOS]

    app = make_app(LocalEngineBackend(make_engine(script)), text_tokenizer, "tiny")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t"), seen


def forced_names(request: GenerationRequest) -> set[str]:
    spec = GrammarSpec.from_text(request.sampling.grammar)
    assert spec.kind == "tool_call"
    return set(spec.schema["calls"])


async def test_chat_required_and_named(front) -> None:
    client, seen = front
    r = await client.post("/v1/chat/completions", json={
        "messages": USER, "tools": CHAT_TOOLS, "tool_choice": "required"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert forced_names(seen[0]) == {"get_weather", "get_time"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = await client.post("/v1/chat/completions", json={
        "messages": USER, "tools": CHAT_TOOLS, "tool_choice": named})
    assert r.status_code == 200, r.text
    assert forced_names(seen[1]) == {"get_weather"}
    await client.post("/v1/chat/completions", json={"messages": USER, "tools": CHAT_TOOLS})
    assert seen[2].sampling.grammar is None  # auto: unconstrained


@pytest.mark.parametrize("extra", [
    {"tool_choice": "required"},
    {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": CHAT_TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
])  # fmt: skip
async def test_chat_refusals_are_400(front, extra) -> None:
    client, seen = front
    r = await client.post("/v1/chat/completions", json={"messages": USER, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice" and not seen


async def test_responses_required_and_named(front) -> None:
    client, seen = front
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "name": "get_time"}, {"get_time"})):  # fmt: skip
        r = await client.post("/v1/responses", json={
            "input": "Say hi", "tools": RESPONSES_TOOLS, "tool_choice": choice})
        assert r.status_code == 200, r.text
        item = r.json()["output"][0]
        assert item["type"] == "function_call"
        assert item["name"] == ("get_time" if names == {"get_time"} else "get_weather")
        assert forced_names(seen[-1]) == names
    bad = await client.post("/v1/responses", json={
        "input": "Say hi", "tools": RESPONSES_TOOLS, "tool_choice": {"type": "function"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


async def test_messages_any_and_tool(front) -> None:
    client, seen = front
    for choice, names in (({"type": "any"}, {"get_weather", "get_time"}),
                          ({"type": "tool", "name": "get_weather"}, {"get_weather"})):
        r = await client.post("/v1/messages", json={
            "max_tokens": 64, "messages": USER, "tools": MESSAGES_TOOLS, "tool_choice": choice})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["stop_reason"] == "tool_use"
        assert body["content"][0]["input"] == {"city": "Paris"}
        assert forced_names(seen[-1]) == names
    for choice in ({"type": "tool"}, {"type": "tool", "name": "nope"}):
        r = await client.post("/v1/messages", json={
            "max_tokens": 64, "messages": USER, "tools": MESSAGES_TOOLS, "tool_choice": choice})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
