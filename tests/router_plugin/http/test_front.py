"""The OpenAI front over a fake engine: bodies, streams, errors, cancellation (no sockets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest, TokenEvent
from mlxcel_plugin.errors import AtCapacityError
from mlxcel_plugin.testing.fake_engine import FakeEngine
from mlxcel_plugin.text import TextTokenizer
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app

MODEL = "tiny"
EOS = 2
USER = [{"role": "user", "content": "Say hi"}]

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def reply(tok: TextTokenizer, text: str, *, eos: bool = True) -> Callable[[Any], list[int]]:
    ids = tok.encode(text, add_special_tokens=False) + ([EOS] if eos else [])
    return lambda request: ids


def echo_last_prompt_tokens(request: GenerationRequest) -> list[int]:
    # Distinct, deterministic output per prompt (for the concurrency test).
    return [t for t in request.prompt_tokens[-12:] if t > 2] + [EOS]


@pytest.fixture
def client_for(text_tokenizer, make_engine):
    clients: list[httpx.AsyncClient] = []

    def make(script, **engine_kwargs) -> tuple[httpx.AsyncClient, FakeEngine]:
        engine = make_engine(script, **engine_kwargs)
        app = make_app(LocalEngineBackend(engine), text_tokenizer, MODEL)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")
        clients.append(client)
        return client, engine

    yield make


def sse_events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n")
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[6:]) for f in frames[:-1]]


def chat_prompt_len(tok: TextTokenizer, messages=USER) -> int:
    return len(tok.encode_chat(tok.render_chat(messages)))


async def chat(client: httpx.AsyncClient, **body) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": USER, **body}
    )


# -- happy paths --------------------------------------------------------------


async def test_chat_non_streaming(client_for, text_tokenizer) -> None:
    client, engine = client_for(reply(text_tokenizer, "Hello, world!"))
    r = await chat(client)
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hello, world!",
        "reasoning_content": None,
    }
    assert choice["finish_reason"] == "stop"
    n_completion = len(text_tokenizer.encode("Hello, world!", add_special_tokens=False)) + 1
    n_prompt = chat_prompt_len(text_tokenizer)
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_completion,
        "total_tokens": n_prompt + n_completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    request = engine.requests[-1]
    assert len(request.prompt_tokens) == n_prompt and request.stop_token_ids == (EOS,)
    assert request.max_tokens == 2048 - n_prompt


async def test_chat_streaming_matches_non_streaming(client_for, text_tokenizer) -> None:
    client, _ = client_for(reply(text_tokenizer, "Héllo 🦙 world"))
    r = await chat(client, stream=True, stream_options={"include_usage": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert content == "Héllo 🦙 world"
    assert chunks[-2]["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"
    }  # fmt: skip
    n_completion = len(text_tokenizer.encode("Héllo 🦙 world", add_special_tokens=False)) + 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == n_completion
    whole = (await chat(client)).json()
    assert whole["choices"][0]["message"]["content"] == content
    assert whole["usage"] == chunks[-1]["usage"]


async def test_stream_without_include_usage_has_no_usage_chunk(client_for, text_tokenizer):
    client, _ = client_for(reply(text_tokenizer, "ok"))
    chunks = sse_events((await chat(client, stream=True)).text)
    assert "usage" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_completions(client_for, text_tokenizer) -> None:
    client, engine = client_for(reply(text_tokenizer, " jumps over"))
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "The fox"})
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == " jumps over"
    assert body["usage"]["prompt_tokens"] == len(text_tokenizer.encode("The fox"))
    assert list(engine.requests[-1].prompt_tokens) == text_tokenizer.encode("The fox")
    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "stream": True})
    chunks = sse_events(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == " jumps over"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_completions_do_not_filter_think_tags(client_for, text_tokenizer) -> None:
    client, _ = client_for(reply(text_tokenizer, "<think>raw</think>"))
    body = (await client.post("/v1/completions", json={"prompt": "x"})).json()
    assert body["choices"][0]["text"] == "<think>raw</think>"


@pytest.mark.parametrize("stop", ["END", ["nope", "END"]])
async def test_stop_strings(client_for, text_tokenizer, stop) -> None:
    client, engine = client_for(reply(text_tokenizer, "one two END three four five six"))
    body = (await chat(client, stop=stop)).json()
    assert body["choices"][0]["message"]["content"] == "one two "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3  # "one", " two", " END"
    chunks = sse_events((await chat(client, stop=stop, stream=True)).text)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "one two "


async def test_max_tokens(client_for, text_tokenizer) -> None:
    client, engine = client_for(reply(text_tokenizer, "a b c d e f g h"))
    for field in ("max_tokens", "max_completion_tokens"):
        body = (await chat(client, **{field: 3})).json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 3
        assert body["choices"][0]["message"]["content"] == "a b c"
        assert engine.requests[-1].max_tokens == 3


async def test_reasoning_split(client_for, text_tokenizer) -> None:
    client, _ = client_for(reply(text_tokenizer, "<think>2+2 is 4.</think>The answer is 4."))
    message = (await chat(client)).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "2+2 is 4."
    assert message["content"] == "The answer is 4."
    chunks = sse_events((await chat(client, stream=True)).text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "2+2 is 4."
    assert "".join(d.get("content", "") for d in deltas) == "The answer is 4."
    assert "<" not in "".join(d.get("content", "") + d.get("reasoning_content", "") for d in deltas)


async def test_tool_calls(client_for, text_tokenizer) -> None:
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    client, _ = client_for(reply(text_tokenizer, call))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    choice = (await chat(client, tools=tools)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    chunks = sse_events((await chat(client, tools=tools, stream=True)).text)
    streamed = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert streamed == [{"index": 0, **tc}]
    assert all("<tool" not in c["choices"][0]["delta"].get("content", "") for c in chunks)


async def test_sampling_params_reach_the_engine(client_for, text_tokenizer) -> None:
    client, engine = client_for(reply(text_tokenizer, "x"))
    await chat(client, temperature=0.5, top_p=0.8, top_k=5, min_p=0.1, repetition_penalty=1.2,
               presence_penalty=0.3, frequency_penalty=0.4, seed=7)  # fmt: skip
    s = engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (
        0.5, 0.8, 5, 0.1, 1.2
    )  # fmt: skip
    assert (s.presence_penalty, s.frequency_penalty, s.seed) == (0.3, 0.4, 7)


async def test_bodies_are_deterministic(client_for, text_tokenizer) -> None:
    client, _ = client_for(reply(text_tokenizer, "<think>a</think>b 🦙 c"))

    def normalized(text: str) -> str:
        return text.replace(json.loads(text.split("data: ")[1])["id"], "ID")

    a = (await chat(client, stream=True)).text
    b = (await chat(client, stream=True)).text
    created_a = json.loads(a.split("data: ")[1])["created"]
    created_b = json.loads(b.split("data: ")[1])["created"]
    assert normalized(a).replace(str(created_a), "T") == normalized(b).replace(str(created_b), "T")


async def test_concurrent_streams_equal_sequential(client_for, text_tokenizer) -> None:
    client, _ = client_for(echo_last_prompt_tokens, token_delay_s=0.001)
    prompts = [[{"role": "user", "content": f"Tell me about number {i} please"}] for i in range(8)]

    async def one(messages) -> str:
        r = await chat(client, messages=messages, stream=True)
        return "".join(c["choices"][0]["delta"].get("content", "") for c in sse_events(r.text))

    sequential = [await one(m) for m in prompts]
    concurrent = await asyncio.gather(*(one(m) for m in prompts))
    assert list(concurrent) == sequential and len(set(sequential)) == 8


async def test_models_health_metrics(client_for, text_tokenizer) -> None:
    client, _ = client_for(reply(text_tokenizer, "hi there"))
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert (await client.get("/health")).json() == {"status": "ok"}
    await chat(client, stream=True)
    metrics = (await client.get("/metrics")).text
    for name in (
        "mlxcel:time_to_first_token_seconds_count",
        "mlxcel:inter_token_latency_seconds_count",
        "mlxcel:e2e_request_latency_seconds_count",
        "mlxcel:prompt_tokens_total",
        "mlxcel:generation_tokens_total",
    ):
        assert name in metrics
    assert f'mlxcel:generation_tokens_total{{model_name="{MODEL}"}} 3.0' in metrics


# -- errors -------------------------------------------------------------------


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param


async def test_bad_inputs_are_openai_errors_and_server_keeps_serving(
    client_for, text_tokenizer
) -> None:
    client, engine = client_for(reply(text_tokenizer, "fine"))
    post = client.post
    cases = [
        (await post("/v1/chat/completions", content=b"{not json"), 400, None),
        (await post("/v1/chat/completions", json=[1, 2]), 400, None),
        (await post("/v1/chat/completions", json={"model": MODEL}), 400, "messages"),
        (await chat(client, messages="hi"), 400, "messages"),
        (await chat(client, max_tokens=0), 400, "max_tokens"),
        (await chat(client, max_tokens=2.5), 400, "max_tokens"),
        (await chat(client, temperature="warm"), 400, "temperature"),
        (await chat(client, n=2), 400, "n"),
        (await chat(client, response_format={"type": "yaml"}), 400, "response_format"),
        (await chat(client, model="gpt-4"), 404, "model"),
        (await post("/v1/completions", json={"prompt": ""}), 400, "prompt"),
        (await post("/v1/completions", json={"prompt": [49152]}), 400, "prompt"),
        (await post("/v1/completions", json={"prompt": "word " * 3000}), 400, "prompt"),
        (await chat(client, messages=[{"role": "user", "content": "word " * 3000}]), 400,
         "messages"),
        (await post("/v1/nowhere", json={}), 404, None),
        (await client.get("/v1/chat/completions"), 405, None),
    ]  # fmt: skip
    for response, status, param in cases:
        assert_openai_error(response, status, param)
    too_long = await post("/v1/completions", json={"prompt": "word " * 3000})
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert not engine.requests  # nothing reached the engine
    ok = await chat(client)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


async def test_max_tokens_clamped_to_context(client_for, text_tokenizer) -> None:
    client, engine = client_for(reply(text_tokenizer, "x"))
    await chat(client, max_tokens=100_000)
    assert engine.requests[-1].max_tokens == 2048 - chat_prompt_len(text_tokenizer)


class ScriptedBackend:
    """A TokenBackend that replays fixed events, or refuses at admission."""

    def __init__(self, events: list[TokenEvent] | None = None, refuse: bool = False):
        self.events, self.refuse, self.closed = events or [], refuse, False

    def is_ready(self) -> bool:
        return not self.refuse

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        if self.refuse:
            raise AtCapacityError("busy", retry_after_s=2.0)
        try:
            for event in self.events:
                yield [event]
        finally:
            self.closed = True


def scripted_client(text_tokenizer, backend) -> httpx.AsyncClient:
    app = make_app(backend, text_tokenizer, MODEL)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")


async def test_admission_refusal_is_503_with_retry_after(text_tokenizer) -> None:
    async with scripted_client(text_tokenizer, ScriptedBackend(refuse=True)) as client:
        for stream in (False, True):
            r = await chat(client, stream=stream)
            assert_openai_error(r, 503)
            assert r.headers["retry-after"] == "2"
        assert (await client.get("/health")).status_code == 503


async def test_engine_error_mid_stream(text_tokenizer) -> None:
    events = [TokenEvent("x", 0, 100), TokenEvent("x", 1, None, FINISH_ERROR, "device lost")]
    async with scripted_client(text_tokenizer, ScriptedBackend(events)) as client:
        r = await chat(client)
        assert_openai_error(r, 500)
        assert r.json()["error"]["code"] == "engine_error"
        chunks = sse_events((await chat(client, stream=True)).text)
        assert chunks[-1]["error"]["message"] == "device lost"


async def test_stream_ending_without_terminal_event_is_node_lost(text_tokenizer) -> None:
    backend = ScriptedBackend([TokenEvent("x", 0, 100)])
    async with scripted_client(text_tokenizer, backend) as client:
        r = await chat(client)
        assert_openai_error(r, 502)


async def test_finished_pipeline_closes_backend_stream(text_tokenizer) -> None:
    ids = text_tokenizer.encode("a b c d e f", add_special_tokens=False)
    backend = ScriptedBackend([TokenEvent("x", i, t) for i, t in enumerate(ids)])
    async with scripted_client(text_tokenizer, backend) as client:
        r = await chat(client, max_tokens=2)
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert backend.closed


# -- disconnects (raw ASGI: the client goes away mid-request) -------------------


async def asgi_call(app, body: dict, gone: asyncio.Event, sent: list[bytes]) -> None:
    """POST ``body`` over raw ASGI; the client disconnects when ``gone`` is set."""
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"",
        "root_path": "", "query_string": b"", "server": ("t", 80), "client": ("c", 1),
        "headers": [(b"content-type", b"application/json")],
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), timeout=10)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_cancels_generation(text_tokenizer, make_engine, stream) -> None:
    endless = text_tokenizer.encode(" la" * 2000, add_special_tokens=False)
    engine = make_engine(lambda r: endless, token_delay_s=0.002)
    app = make_app(LocalEngineBackend(engine), text_tokenizer, MODEL)
    gone, sent = asyncio.Event(), []
    call = asyncio.create_task(asgi_call(app, {"messages": USER, "stream": stream}, gone, sent))
    # Disconnect mid-generation: after a few chunks (stream) or live tokens (non-stream).
    await wait_until(lambda: len(sent) >= 3 if stream else bool(engine.live_ids()))
    await asyncio.sleep(0.05)
    gone.set()
    await call
    await wait_until(lambda: engine.cancelled == [engine.requests[0].request_id])
    await wait_until(lambda: not engine.live_ids())


async def test_framework_validation_errors_are_openai_shaped() -> None:
    from fastapi import FastAPI

    from router_plugin.http.front import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/typed")
    async def typed(count: int) -> dict:
        return {"count": count}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        assert_openai_error(await c.get("/typed?count=x"), 422)
