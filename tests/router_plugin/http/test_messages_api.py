"""``/v1/messages`` over a scripted fake engine: translation, blocks, events, errors."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest, TokenEvent
from mlxcel_plugin.text import TextTokenizer
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app
from router_plugin.http.options import FrontOptions
from tests.router_plugin.http.test_front import ScriptedBackend
from tests.router_plugin.http.test_responses_api import agent_answer, agent_sized_tools, replies

MODEL = "tiny"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
USER = [{"role": "user", "content": "Say hi"}]
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def make_front(text_tokenizer, make_engine):
    def make(answer=agent_answer, **options: Any):
        seen: list[GenerationRequest] = []
        engine = make_engine(replies(text_tokenizer, answer, seen))
        app = make_app(LocalEngineBackend(engine), text_tokenizer, MODEL,
                       options=FrontOptions(**options))  # fmt: skip
        return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t"), seen

    return make


@pytest.fixture
def front(make_front):
    return make_front()


def prompt_text(tok: TextTokenizer, request: GenerationRequest) -> str:
    return tok.decode(list(request.prompt_tokens))


def events_of(text: str) -> list[dict[str, Any]]:
    out = []
    for frame in (f for f in text.split("\n\n") if f):
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    return out


async def messages(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/messages?beta=true", json={
        "model": MODEL, "max_tokens": 64, "messages": USER, **body},
        headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x"})


async def test_a_text_answer(front, text_tokenizer) -> None:
    client, seen = front
    r = await messages(client, system=[{"type": "text", "text": "Be brief."}])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": "Hello there."}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    assert body["usage"]["input_tokens"] == len(seen[0].prompt_tokens)
    assert body["usage"]["cache_read_input_tokens"] == 0
    prompt = prompt_text(text_tokenizer, seen[0])
    assert prompt.index("Be brief.") < prompt.index("Say hi")


async def test_the_prompt_is_the_chat_completions_prompt(front) -> None:
    client, seen = front
    await client.post("/v1/chat/completions", json={"messages": [
        {"role": "system", "content": "Be brief."}, *USER]})
    await messages(client, system="Be brief.")
    assert seen[0].prompt_tokens == seen[1].prompt_tokens


async def test_a_tool_use_round_trip(front, text_tokenizer) -> None:
    client, seen = front
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = await messages(client, messages=ask, tools=[WEATHER])
    body = r.json()
    assert body["stop_reason"] == "tool_use"
    (block,) = body["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["input"] == {"city": "Paris"}
    follow = await messages(client, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": body["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]}]}])
    assert follow.status_code == 200, follow.text
    assert follow.json()["content"] == [{"type": "text", "text": "It is sunny in Paris."}]
    prompt = prompt_text(text_tokenizer, seen[1])
    assert prompt.index("Weather in Paris?") < prompt.index("sunny, 21 C")


async def test_the_stream_sends_anthropics_event_sequence(front) -> None:
    client, _ = front
    r = await messages(client, stream=True)
    events = events_of(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "Hello there."
    assert events[-2]["delta"]["stop_reason"] == "end_turn"
    assert events[-2]["usage"]["output_tokens"] > 0


async def test_a_streamed_tool_use_sends_input_json_delta(front) -> None:
    client, _ = front
    r = await messages(client, stream=True, tools=[WEATHER],
                       messages=[{"role": "user", "content": "Weather in Paris?"}])
    events = events_of(r.text)
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert events[2]["content_block"]["type"] == "tool_use"
    assert json.loads(events[3]["delta"]["partial_json"]) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


async def test_reasoning_is_a_thinking_block(make_front) -> None:
    client, _ = make_front(lambda prompt: "<think>2+2 is 4.</think>The answer is 4.")
    body = (await messages(client)).json()
    assert [b["type"] for b in body["content"]] == ["thinking", "text"]
    assert body["content"][0]["thinking"] == "2+2 is 4."
    events = events_of((await messages(client, stream=True)).text)
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"


async def test_max_tokens_is_required_and_clamped(front) -> None:
    client, seen = front
    r = await client.post("/v1/messages", json={"model": MODEL, "messages": USER})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    ok = await messages(client, max_tokens=32000)
    assert ok.status_code == 200 and seen[0].max_tokens < 32000


async def test_stop_sequences_and_sampling_reach_the_request(front) -> None:
    client, seen = front
    r = await messages(client, stop_sequences=["xyz", "there"], temperature=0.5, top_p=0.9,
                       top_k=4)  # fmt: skip
    body = r.json()
    assert body["content"] == [{"type": "text", "text": "Hello "}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "there")
    sampling = seen[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.9, 4)


async def test_a_streamed_stop_sequence_is_named_in_message_delta(front) -> None:
    client, _ = front
    events = events_of((await messages(client, stream=True, stop_sequences=["ere."])).text)
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "Hello th"
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "ere."}
    unmatched = events_of((await messages(client, stream=True, stop_sequences=["zzz"])).text)
    assert unmatched[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


async def test_count_tokens(front) -> None:
    client, seen = front
    r = await client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": USER})
    await messages(client)
    assert r.json() == {"input_tokens": len(seen[0].prompt_tokens)}


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"messages": "hi"}, 400, "invalid_request_error"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request_error"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                 "tool_use_id": "nope", "content": "x"}]}]},
     400, "invalid_request_error"),
    ({"max_tokens": "lots"}, 400, "invalid_request_error"),
    ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error"),
    ({"model": "claude-other"}, 404, "not_found_error"),
    ({"stream": "yes"}, 400, "invalid_request_error"),
])
async def test_bad_input_is_an_anthropic_shaped_error(front, body, status, kind) -> None:
    client, _ = front
    r = await messages(client, **body)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind


async def test_a_prompt_over_the_context_is_invalid_request(front) -> None:
    client, _ = front
    r = await messages(client, messages=[{"role": "user", "content": "word " * 300_000}])
    assert r.status_code in (400, 413) and r.json()["type"] == "error"


async def test_agent_client_fields_are_accepted(front) -> None:
    client, _ = front
    r = await messages(client, metadata={"user_id": "u"}, thinking={"type": "adaptive"},
                       context_management={"edits": []}, output_config={"effort": "low"},
                       tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search"}])
    assert r.status_code == 200, r.text


async def test_x_api_key_is_accepted_and_a_refusal_is_anthropic_shaped(make_front) -> None:
    client, _ = make_front(api_keys=frozenset({"sekret"}))
    refused = await messages(client)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    ok = await client.post("/v1/messages", json={"max_tokens": 8, "messages": USER},
                           headers={"x-api-key": "sekret"})
    assert ok.status_code == 200, ok.text
    bearer = await client.post("/v1/responses", json={"input": "hi"},
                               headers={"Authorization": "Bearer sekret"})
    assert bearer.status_code == 200


async def test_an_engine_error_is_an_anthropic_error_or_error_event(text_tokenizer) -> None:
    events = [TokenEvent("x", 0, 100), TokenEvent("x", 1, None, FINISH_ERROR, "device lost")]
    app = make_app(ScriptedBackend(events), text_tokenizer, MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await messages(c)
        assert r.status_code == 500
        assert r.json() == {"type": "error", "error": {"type": "api_error",
                                                       "message": "device lost"}}
        streamed = events_of((await messages(c, stream=True)).text)
        assert streamed[0]["type"] == "message_start"
        assert streamed[-1] == {"type": "error", "error": {"type": "api_error",
                                                           "message": "device lost"}}


async def test_admission_refusal_is_an_overloaded_error(text_tokenizer) -> None:
    app = make_app(ScriptedBackend(refuse=True), text_tokenizer, MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await messages(c, stream=True)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "overloaded_error"


async def test_an_agent_sized_body_is_served(front) -> None:
    client, _ = front
    tools = [{"name": t["name"], "description": t["description"],
              "input_schema": t["parameters"]} for t in agent_sized_tools(24)]
    body = {"model": MODEL, "max_tokens": 32000, "system": "rule. " * 1000, "tools": tools,
            "messages": USER, "metadata": {"user_id": "u"}}
    assert 40_000 < len(json.dumps(body)) < 80_000
    r = await client.post("/v1/messages?beta=true", json=body,
                          headers={"anthropic-beta": "context-management-2025-06-27"})
    assert r.status_code == 200, r.text
