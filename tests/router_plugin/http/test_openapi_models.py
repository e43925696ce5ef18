"""``/openapi.json`` and ``/docs``: every endpoint has its models; answers match them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app

MODEL = "tiny"
USER = [{"role": "user", "content": "Say hi"}]

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def validator(schema: dict, name: str) -> jsonschema.Validator:
    """A validator for ``components.schemas[name]``, its refs resolved in ``schema``."""
    root = {"$ref": f"#/components/schemas/{name}", "components": schema["components"]}
    return jsonschema.Draft202012Validator(root)


def sse_chunks(text: str) -> list[dict]:
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]


@pytest.fixture
async def client(text_tokenizer, make_engine):
    ids = text_tokenizer.encode("fine", add_special_tokens=False) + [2]
    app = make_app(LocalEngineBackend(make_engine(lambda r: ids)), text_tokenizer, MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        yield c


async def test_every_endpoint_is_described(client) -> None:
    schema = (await client.get("/openapi.json")).json()
    paths = schema["paths"]
    assert set(paths) >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                          "/metrics"}  # fmt: skip
    for path in ("/v1/chat/completions", "/v1/completions"):
        post = paths[path]["post"]
        assert "$ref" in post["requestBody"]["content"]["application/json"]["schema"]
        assert set(post["responses"]["200"]["content"]) == {"application/json",
                                                            "text/event-stream"}  # fmt: skip
        assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatCompletion", "TextCompletion",
            "ChatCompletionChunk", "ModelList", "ErrorResponse"} <= set(
                schema["components"]["schemas"])  # fmt: skip
    docs = await client.get("/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text


async def test_answers_match_their_models(client) -> None:
    schema = (await client.get("/openapi.json")).json()
    chat = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    validator(schema, "ChatCompletion").validate(chat.json())
    text = await client.post("/v1/completions", json={"prompt": "Hi"})
    validator(schema, "TextCompletion").validate(text.json())
    stream = await client.post("/v1/chat/completions", json={
        "messages": USER, "stream": True, "stream_options": {"include_usage": True}})
    for chunk in sse_chunks(stream.text):
        validator(schema, "ChatCompletionChunk").validate(chunk)
    text_stream = await client.post("/v1/completions", json={"prompt": "Hi", "stream": True})
    for chunk in sse_chunks(text_stream.text):
        validator(schema, "TextCompletion").validate(chunk)
    validator(schema, "ModelList").validate((await client.get("/v1/models")).json())
    validator(schema, "HealthStatus").validate((await client.get("/health")).json())
    refused = await client.post("/v1/chat/completions", json={"messages": []})
    validator(schema, "ErrorResponse").validate(refused.json())


async def test_requests_the_schema_refuses_are_refused(client) -> None:
    schema = (await client.get("/openapi.json")).json()
    check = validator(schema, "ChatCompletionRequest")
    for body in ({"messages": USER, "tool_choice": "sometimes"},
                 {"messages": USER, "chat_template_kwargs": []},
                 {"messages": USER, "tools": [{"type": "web", "function": {"name": "f"}}]},
                 {"messages": [{"role": "user", "content": "a", "tool_call_id": 3}]}):  # fmt: skip
        assert not check.is_valid(body)
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, (body, response.text)
