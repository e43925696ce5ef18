"""The front with tool-result turns and response_format (fake engine, embedded template)."""

from __future__ import annotations

import json

import httpx
import pytest

from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.structured_output import GrammarSpec
from mlxcel_plugin.testing.fake_engine import FakeEngine
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app

MODEL = "tiny"
EOS = 2
pytestmark = pytest.mark.anyio
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
# As the openai SDK sends a follow-up turn: null content, arguments as JSON text.
FOLLOW_UP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def front(text_tokenizer, make_engine):
    seen: list[GenerationRequest] = []
    answer = text_tokenizer.encode('{"ok": true}', add_special_tokens=False) + [EOS]

    def script(request: GenerationRequest) -> list[int]:
        seen.append(request)
        return answer

    engine: FakeEngine = make_engine(script)
    app = make_app(LocalEngineBackend(engine), text_tokenizer, MODEL)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t"), seen


async def test_a_tool_result_turn_is_served_on_the_embedded_template(front,
                                                                     text_tokenizer) -> None:
    client, seen = front
    async with client:
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": FOLLOW_UP, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    prompt = text_tokenizer.decode(list(seen[0].prompt_tokens))
    assert '"name": "get_weather"' in prompt and "sunny, 21 C" in prompt


async def test_response_format_reaches_the_engine_as_the_grammar_spec(front) -> None:
    client, seen = front
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema,
                                                  "strict": True}}
    async with client:
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": FOLLOW_UP[:1], "response_format": fmt})
        refused = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": FOLLOW_UP[:1], "response_format": {
                "type": "json_schema", "json_schema": {"name": "bad", "strict": True,
                                                       "schema": {"not": {}}}}})
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"ok": True}
    assert GrammarSpec.from_text(seen[0].sampling.grammar).schema == schema
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
