"""Bad bodies at the HTTP edge: OpenAI-shaped 4xx, counted, nothing reaches the engine."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from mlxcel_plugin.errors import InvalidRequestError, UnsupportedMediaTypeError
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app
from router_plugin.http.options import FrontOptions
from router_plugin.http.request_limits import check_media_type, check_tree, parse_json_body

MODEL = "tiny"
EOS = 2
USER = [{"role": "user", "content": "Say hi"}]
LIMIT = 64 * 1024

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_edge(tokenizer, engine, limit: int):
    options = FrontOptions(max_request_bytes=limit, off_loop_bytes=4096)
    app = make_app(LocalEngineBackend(engine), tokenizer, MODEL, options=options)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")
    return client, engine, app


@pytest.fixture
def edge(text_tokenizer, make_engine):
    ids = text_tokenizer.encode("fine", add_special_tokens=False) + [EOS]
    return make_edge(text_tokenizer, make_engine(lambda request: ids), LIMIT)


def raw_chat(client: httpx.AsyncClient, raw: bytes, content_type="application/json", **kw):
    return client.post("/v1/chat/completions", content=raw,
                       headers={"content-type": content_type}, **kw)  # fmt: skip


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


async def test_hostile_bodies_are_4xx_and_counted(edge) -> None:
    client, engine, _ = edge
    deep = b'{"messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    cases = [
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400),
        (b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', 400),
        (b'{"messages": [{"role": "user", "content": "a"}], "min_p": 1e999}', 400),
        (b'{"messages": [{"role": {}, "content": "a"}]}', 400),
        (b'{"messages": [{"role": [1], "content": "a"}]}', 400),
        (b'{"messages": [{"role": "user", "content": "a"}], "seed": ' + b"9" * 30 + b"}", 400),
        (b'{"messages": [{"role": "user", "content": "a"}], "top_k": -' + b"9" * 30 + b"}", 400),
        (b'{"messages": [{"role": "user", "content": "a"}], "user": {}}', 400),
        (deep, 400),
    ]
    for raw, status in cases:
        error_of(await raw_chat(client, raw), status)
    error_of(await raw_chat(client, json.dumps({"messages": USER}).encode(), "text/plain"), 415)
    assert not engine.requests
    metrics = (await client.get("/metrics")).text
    assert 'code="invalid_request",model_name="tiny",status="400"} 9.0' in metrics
    assert 'code="unsupported_media_type",model_name="tiny",status="415"} 1.0' in metrics
    ok = await raw_chat(client, json.dumps({"messages": USER}).encode())
    assert ok.status_code == 200, ok.text


async def test_body_over_the_limit_is_413_declared_or_streamed(edge) -> None:
    client, engine, _ = edge
    big = json.dumps({"messages": [{"role": "user", "content": "x" * LIMIT}]}).encode()
    assert error_of(await raw_chat(client, big), 413)["code"] == "request_too_large"

    async def chunks():  # no Content-Length: refused once the count passes the limit
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    streamed = await client.post("/v1/chat/completions", content=chunks())
    assert error_of(streamed, 413)["code"] == "request_too_large"
    assert not engine.requests


async def test_prompt_over_the_context_is_refused_before_tokenizing(
    text_tokenizer, make_engine, monkeypatch
) -> None:
    client, engine, app = make_edge(text_tokenizer, make_engine(lambda r: [EOS]), 1 << 20)
    tokenizer = app.state.front.tokenizer
    calls = []
    monkeypatch.setattr(tokenizer, "encode_in_thread", lambda *a, **k: calls.append(a))
    # 2048-token context, at most 162 bytes a token: 400k characters cannot fit.
    assert tokenizer.max_token_bytes == 162 and app.state.front.context_length == 2048
    text = "word " * 80_000
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                       ("/v1/completions", {"prompt": text})):  # fmt: skip
        error = error_of(await client.post(path, json=body), 400)
        assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    assert not calls and not engine.requests


async def test_big_bodies_are_planned_in_a_worker_thread(edge, monkeypatch) -> None:
    client, _, app = edge
    tokenizer = app.state.front.tokenizer
    threads, encode = [], tokenizer.encode_in_thread

    def spy(text, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        return encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode_in_thread", spy)
    text = "hello there " * 800  # ~10 KB: over off_loop_bytes, within the context
    response = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert threads == [False]  # encoded, once, off the event loop's thread
    assert response.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(text))


async def test_off_loop_prompt_over_the_context_gets_its_exact_count(edge, text_tokenizer):
    client, engine, _ = edge
    text = "word " * 3000  # over off_loop_bytes; within the size bound, over 2048 tokens
    exact = len(text_tokenizer.encode_chat(text_tokenizer.render_chat(
        [{"role": "user", "content": text}])))  # fmt: skip
    response = await client.post("/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": text}]})
    error = error_of(response, 400)
    assert error["code"] == "context_length_exceeded"
    assert f"has {exact} tokens" in error["message"]
    count = text_tokenizer.encode_in_thread(text, max_tokens=2048)
    assert count == len(text_tokenizer.encode(text))  # a count, not the ids
    assert not engine.requests


async def test_405_carries_allow_and_404_is_counted(edge) -> None:
    client, _, _ = edge
    wrong = await client.get("/v1/chat/completions")
    error_of(wrong, 405)
    assert wrong.headers["allow"] == "POST"
    error_of(await client.get("/v1/nowhere"), 404)
    metrics = (await client.get("/metrics")).text
    assert 'code="method_not_allowed",model_name="tiny",status="405"} 1.0' in metrics
    assert 'code="not_found",model_name="tiny",status="404"} 1.0' in metrics


def test_media_types() -> None:
    for ok in (None, "", "application/json", "application/json; charset=utf-8",
               "application/merge+json"):  # fmt: skip
        check_media_type(ok)
    for bad in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        with pytest.raises(UnsupportedMediaTypeError):
            check_media_type(bad)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b'"x"', b"\xff\xfe", b"null", b"Infinity",
                                 b'{"a": -Infinity}', b'{"\\udfff": 1}'])  # fmt: skip
def test_bad_json_bodies(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        parse_json_body(raw, 64)


def test_the_quick_scan_misses_nothing() -> None:
    for raw in (b'{"a": ' + b"1" * 400 + b".5}", b'{"a": 1E+999}',
                json.dumps({"t": "\udc00"}).encode("utf-16"),
                json.dumps({"a": [[[[1]]]]}).encode("utf-32")):  # fmt: skip
        with pytest.raises(InvalidRequestError):
            parse_json_body(raw, 3)
    assert parse_json_body(b'{"a": 1e99, "b": "\\u00e9"}', 3) == {"a": 1e99, "b": "\u00e9"}


def test_tree_depth_and_surrogate_pairs() -> None:
    check_tree({"a": [[[1]]]}, 4)
    with pytest.raises(InvalidRequestError):
        check_tree({"a": [[[1]]]}, 3)
    # An escaped pair is one valid character (what json.dumps writes for emoji).
    assert parse_json_body(json.dumps({"text": "\U0001f600"}).encode(), 4)["text"] == "\U0001f600"
