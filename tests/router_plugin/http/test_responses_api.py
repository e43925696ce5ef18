"""``/v1/responses`` over a scripted fake engine: translation, items, events, store (no sockets)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest, TokenEvent
from mlxcel_plugin.structured_output import GrammarSpec
from mlxcel_plugin.text import TextTokenizer
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app
from router_plugin.http.responses_api.store import COUNT_ENV, ResponseStore
from tests.router_plugin.http.test_front import ScriptedBackend

MODEL = "tiny"
EOS = 2
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def replies(tok: TextTokenizer, answer: Callable[[str], str],
            seen: list[GenerationRequest]) -> Callable[[GenerationRequest], list[int]]:
    """A script answering from the prompt's text (what a model would see)."""

    def script(request: GenerationRequest) -> list[int]:
        seen.append(request)
        prompt = tok.decode(list(request.prompt_tokens))
        return tok.encode(answer(prompt), add_special_tokens=False) + [EOS]

    return script


def agent_answer(prompt: str) -> str:
    if "sunny, 21 C" in prompt:
        return "It is sunny in Paris."
    if "Weather" in prompt:  # the tiny model's template does not render tool lists
        return CALL
    return "Hello there."


@pytest.fixture
def front(text_tokenizer, make_engine, monkeypatch):
    seen: list[GenerationRequest] = []
    engine = make_engine(replies(text_tokenizer, agent_answer, seen))
    monkeypatch.setenv(COUNT_ENV, "3")
    app = make_app(LocalEngineBackend(engine), text_tokenizer, MODEL)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")
    return client, seen, app


def prompt_text(tok: TextTokenizer, request: GenerationRequest) -> str:
    return tok.decode(list(request.prompt_tokens))


def events_of(text: str) -> list[dict[str, Any]]:
    frames = [f for f in text.split("\n\n") if f]
    out = []
    for frame in frames:
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    return out


async def test_a_string_input_answers_with_one_message_item(front, text_tokenizer) -> None:
    client, seen, _ = front
    r = await client.post("/v1/responses", json={"model": MODEL, "input": "Say hi",
                                                  "instructions": "Be brief."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0] == {"type": "output_text", "text": "Hello there.",
                                  "annotations": [], "logprobs": []}
    usage = body["usage"]
    assert usage["input_tokens"] == len(seen[0].prompt_tokens)
    assert usage["output_tokens"] == len(text_tokenizer.encode("Hello there.",
                                                               add_special_tokens=False)) + 1
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    prompt = prompt_text(text_tokenizer, seen[0])
    assert prompt.index("Be brief.") < prompt.index("Say hi")


async def test_the_prompt_is_the_chat_completions_prompt(front, text_tokenizer) -> None:
    client, seen, _ = front
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    await client.post("/v1/chat/completions", json={"messages": chat})
    await client.post("/v1/responses", json={"input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                          "text": "Say hi"}]}],
        "instructions": "Be brief."})
    assert seen[0].prompt_tokens == seen[1].prompt_tokens


async def test_a_tool_call_is_a_function_call_item_and_its_output_continues(front,
                                                                            text_tokenizer) -> None:
    client, seen, _ = front
    r = await client.post("/v1/responses", json={"input": "Weather in Paris?",
                                                  "tools": [WEATHER]})
    (call,) = r.json()["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    follow = await client.post("/v1/responses", json={
        "previous_response_id": r.json()["id"], "tools": [WEATHER],
        "input": [{"type": "function_call_output", "call_id": call["call_id"],
                   "output": "sunny, 21 C"}]})
    assert follow.status_code == 200, follow.text
    assert follow.json()["output"][0]["content"][0]["text"] == "It is sunny in Paris."
    prompt = prompt_text(text_tokenizer, seen[1])
    assert prompt.index("Weather in Paris?") < prompt.index("sunny, 21 C")


async def test_the_whole_history_as_items_matches_the_continuation(front, text_tokenizer) -> None:
    client, seen, _ = front
    first = (await client.post("/v1/responses", json={"input": "Weather in Paris?",
                                                       "tools": [WEATHER]})).json()
    call = first["output"][0]
    await client.post("/v1/responses", json={"previous_response_id": first["id"],
                                              "tools": [WEATHER], "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21 C"}]})
    await client.post("/v1/responses", json={"tools": [WEATHER], "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {k: call[k] for k in ("type", "call_id", "name", "arguments")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21 C"}]})
    assert seen[1].prompt_tokens == seen[2].prompt_tokens


async def test_the_stream_sends_the_typed_event_sequence(front) -> None:
    client, _, _ = front
    r = await client.post("/v1/responses", json={"input": "Say hi", "stream": True})
    events = events_of(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Hello there." == events[-1]["response"]["output"][0]["content"][0]["text"]


async def test_a_streamed_tool_call_sends_function_call_argument_events(front) -> None:
    client, _, _ = front
    r = await client.post("/v1/responses", json={"input": "Weather in Paris?", "tools": [WEATHER],
                                                  "stream": True})
    kinds = [e["type"] for e in events_of(r.text)]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]


async def test_max_output_tokens_leaves_the_response_incomplete(front) -> None:
    client, _, _ = front
    body = (await client.post("/v1/responses", json={"input": "Say hi",
                                                      "max_output_tokens": 2})).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    r = await client.post("/v1/responses", json={"input": "Say hi", "max_output_tokens": 2,
                                                  "stream": True})
    assert events_of(r.text)[-1]["type"] == "response.incomplete"


async def test_text_format_reaches_the_engine_as_a_grammar(front) -> None:
    client, seen, _ = front
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = await client.post("/v1/responses", json={"input": "Say hi", "text": {"format": {
        "type": "json_schema", "name": "ok", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    assert GrammarSpec.from_text(seen[0].sampling.grammar).schema == schema
    bad = await client.post("/v1/responses", json={"input": "Say hi", "text": {"format": {
        "type": "json_schema", "name": "bad", "strict": True, "schema": {"not": {}}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format"


async def test_sampling_fields_reach_the_engine(front) -> None:
    client, seen, _ = front
    await client.post("/v1/responses", json={"input": "hi", "temperature": 0.5, "top_p": 0.8,
                                              "seed": 7, "max_output_tokens": 30})
    sampling = seen[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.5, 0.8, 7)
    assert seen[0].max_tokens == 30


async def test_get_and_delete_a_stored_response(front) -> None:
    client, _, _ = front
    body = (await client.post("/v1/responses", json={"input": "Say hi"})).json()
    got = await client.get(f"/v1/responses/{body['id']}")
    assert got.status_code == 200 and got.json() == body
    deleted = await client.delete(f"/v1/responses/{body['id']}")
    assert deleted.json() == {"id": body["id"], "object": "response", "deleted": True}
    gone = await client.get(f"/v1/responses/{body['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    again = await client.post("/v1/responses", json={"input": "x",
                                                      "previous_response_id": body["id"]})
    assert again.status_code == 400
    assert again.json()["error"]["code"] == "previous_response_not_found"


async def test_store_false_keeps_nothing(front) -> None:
    client, _, _ = front
    body = (await client.post("/v1/responses", json={"input": "Say hi", "store": False})).json()
    assert body["store"] is False
    assert (await client.get(f"/v1/responses/{body['id']}")).status_code == 404


async def test_the_store_drops_the_oldest_past_its_count(front) -> None:
    client, _, app = front
    ids = [(await client.post("/v1/responses", json={"input": f"hi {i}"})).json()["id"]
           for i in range(4)]
    assert len(app.state.response_store) == 3
    assert (await client.get(f"/v1/responses/{ids[0]}")).status_code == 404
    assert (await client.get(f"/v1/responses/{ids[3]}")).status_code == 200


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
    ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "hi", "temperature": 9}, "temperature"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "store": "yes"}, "store"),
])
async def test_bad_input_is_an_openai_shaped_400(front, body, param) -> None:
    client, _, _ = front
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


async def test_agent_client_fields_are_accepted_and_hosted_tools_skipped(front) -> None:
    client, _, _ = front
    r = await client.post("/v1/responses", json={
        "input": "Say hi", "store": False, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "abc", "parallel_tool_calls": True, "metadata": {"a": "b"},
        "reasoning": {"effort": "low"}, "tools": [{"type": "web_search"}]})
    assert r.status_code == 200, r.text


async def test_requests_are_counted_per_api(front) -> None:
    client, _, _ = front
    await client.post("/v1/responses", json={"input": "Say hi"})
    metrics = (await client.get("/metrics")).text
    assert 'mlxcel:api_requests_total{api="responses",model_name="tiny"} 1.0' in metrics


def test_the_store_is_bounded_by_bytes() -> None:
    store = ResponseStore(max_count=100, max_bytes=400)
    for i in range(5):
        assert store.put({"id": f"r{i}", "text": "x" * 100}, [])
    assert store.size_bytes <= 400 and store.get("r0") is None and store.get("r4") is not None
    assert not store.put({"id": "big", "text": "x" * 500}, [])


# -- failures -------------------------------------------------------------------------


def scripted_app(text_tokenizer, backend) -> httpx.AsyncClient:
    app = make_app(backend, text_tokenizer, MODEL)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")


async def test_an_engine_error_is_a_500_or_a_failed_event(text_tokenizer) -> None:
    events = [TokenEvent("x", 0, 100), TokenEvent("x", 1, None, FINISH_ERROR, "device lost")]
    async with scripted_app(text_tokenizer, ScriptedBackend(events)) as client:
        r = await client.post("/v1/responses", json={"input": "hi"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        streamed = events_of((await client.post("/v1/responses", json={
            "input": "hi", "stream": True})).text)
        failed = streamed[-1]
        assert failed["type"] == "response.failed"
        assert failed["response"]["status"] == "failed"
        assert failed["response"]["error"] == {"code": "engine_error", "message": "device lost"}
        kept = await client.get(f"/v1/responses/{failed['response']['id']}")
        assert kept.status_code == 404  # a failed response is not stored


async def test_admission_refusal_is_503_with_retry_after(text_tokenizer) -> None:
    async with scripted_app(text_tokenizer, ScriptedBackend(refuse=True)) as client:
        for stream in (False, True):
            r = await client.post("/v1/responses", json={"input": "hi", "stream": stream})
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "at_capacity"


async def test_a_prompt_over_the_context_is_context_length_exceeded(front) -> None:
    client, _, _ = front
    r = await client.post("/v1/responses", json={"input": "word " * 3000})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def agent_sized_tools(count: int) -> list[dict[str, Any]]:
    """``count`` function tools with schemas about as big as a coding agent's."""
    props = {f"arg_{i}": {"type": "string", "description": "x" * 80} for i in range(12)}
    return [{"type": "function", "name": f"tool_{n}", "description": "d" * 400,
             "parameters": {"type": "object", "properties": props}} for n in range(count)]


async def test_an_agent_sized_body_is_served(front) -> None:
    client, _, _ = front
    body = {"input": "Say hi", "instructions": "rule. " * 1000, "tools": agent_sized_tools(24),
            "store": False, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k", "parallel_tool_calls": False}
    assert 40_000 < len(json.dumps(body)) < 80_000
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
