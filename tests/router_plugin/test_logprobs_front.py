"""Logprobs and echo on the OpenAI front over the fake engine (its logprobs are a pure
function: mlxcel_plugin/testing/fake_logprobs.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from mlxcel_plugin.testing.fake_engine import SCRIPTED_VOCAB_SIZE
from mlxcel_plugin.testing.fake_logprobs import fake_logprobs
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


@pytest.fixture
def serve(text_tokenizer: TextTokenizer, make_engine):
    def make(text: str, *, eos: bool = True) -> tuple[httpx.AsyncClient, list[int]]:
        ids = text_tokenizer.encode(text, add_special_tokens=False) + ([EOS] if eos else [])
        engine = make_engine(lambda request: ids)
        app = make_app(LocalEngineBackend(engine), text_tokenizer, MODEL)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t"), ids

    return make


def sse_events(text: str) -> list[Any]:
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[6:]) for f in frames[:-1]]


def expected(position: int, token: int, top: int):
    return fake_logprobs(position, token, top, SCRIPTED_VOCAB_SIZE)


async def test_chat_logprobs_with_top_alternatives(serve, text_tokenizer) -> None:
    client, ids = serve("Hello, world!")
    r = await client.post("/v1/chat/completions", json={
        "messages": USER, "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    prompt_len = r.json()["usage"]["prompt_tokens"]
    assert len(content) == len(ids)  # the EOS token is reported too (as vLLM)
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        want = expected(prompt_len + i, token, 3)
        assert entry["token"] == text_tokenizer.decode([token])
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == want.logprob
        assert [t["logprob"] for t in entry["top_logprobs"]] == list(want.top_logprobs)
        assert [t["token"] for t in entry["top_logprobs"]] == [
            text_tokenizer.decode([t]) for t in want.top_ids]


async def test_chat_without_logprobs_keeps_null(serve) -> None:
    client, _ = serve("Hello")
    r = await client.post("/v1/chat/completions", json={"messages": USER})
    assert r.json()["choices"][0]["logprobs"] is None


async def test_chat_stream_carries_every_tokens_logprobs_once(serve) -> None:
    client, ids = serve("Hello, world! How are you?")
    body = {"messages": USER, "logprobs": True, "stream": True}
    streamed = await client.post("/v1/chat/completions", json=body)
    full = await client.post("/v1/chat/completions", json={**body, "stream": False})
    chunks = sse_events(streamed.text)
    entries = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {})
                                           .get("content") or [])]
    assert entries == full.json()["choices"][0]["logprobs"]["content"]
    assert len(entries) == len(ids)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == full.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body,message", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
async def test_chat_logprobs_bounds(serve, body, message) -> None:
    client, _ = serve("Hi")
    r = await client.post("/v1/chat/completions", json={"messages": USER, **body})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == message


async def test_completion_logprobs_bound_is_5(serve) -> None:
    client, _ = serve("Hi")
    r = await client.post("/v1/completions", json={"prompt": "a", "logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


async def test_completion_logprobs(serve, text_tokenizer) -> None:
    client, ids = serve(" one two", eos=False)
    r = await client.post("/v1/completions", json={"prompt": "Count:", "logprobs": 2,
                                                   "max_tokens": len(ids)})
    choice = r.json()["choices"][0]
    prompt_len = r.json()["usage"]["prompt_tokens"]
    lp = choice["logprobs"]
    assert lp["tokens"] == [text_tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"] == [expected(prompt_len + i, t, 2).logprob
                                    for i, t in enumerate(ids)]
    assert all(len(top) == 2 for top in lp["top_logprobs"])  # the chosen token leads its top
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == choice["text"]


async def test_echo_with_max_tokens_0_is_the_prompt_and_its_logprobs(serve,
                                                                     text_tokenizer) -> None:
    client, _ = serve(" never shown")
    prompt = "The quick brown fox"
    r = await client.post("/v1/completions", json={"prompt": prompt, "echo": True,
                                                   "logprobs": 1, "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    ids = text_tokenizer.encode(prompt)
    assert choice["text"] == prompt
    assert body["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [expected(i, t, 1).logprob
                                        for i, t in enumerate(ids) if i > 0]
    assert len(lp["tokens"]) == len(ids)


async def test_echo_with_a_generated_token_ends_with_it(serve, text_tokenizer) -> None:
    """What lm-eval's loglikelihood sends: echo, logprobs 1, max_tokens 1 (it drops the last)."""
    client, ids = serve(" fox", eos=False)
    prompt = [5, 6, 7, 8]
    r = await client.post("/v1/completions", json={"prompt": [prompt], "echo": True,
                                                   "logprobs": 1, "max_tokens": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) + 1
    assert lp["token_logprobs"][-1] == expected(len(prompt), ids[0], 1).logprob
    assert r.json()["choices"][0]["text"] == text_tokenizer.decode(prompt) + " fox"


async def test_echo_stream_sends_the_prompt_first(serve) -> None:
    client, _ = serve(" jumps")
    body = {"prompt": "The fox", "echo": True, "logprobs": 0, "max_tokens": 3}
    streamed = sse_events((await client.post("/v1/completions",
                                             json={**body, "stream": True})).text)
    full = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert streamed[0]["choices"][0]["text"].startswith("The fox")
    assert "".join(c["choices"][0]["text"] for c in streamed) == full["text"]
    values = [v for c in streamed if c["choices"][0]["logprobs"]
              for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert values == full["logprobs"]["token_logprobs"]


async def test_max_tokens_0_needs_echo(serve) -> None:
    client, _ = serve("x")
    r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


class OldNodes:
    """A backend whose nodes predate logprobs: their events carry none."""

    def is_ready(self) -> bool:
        return True

    async def stream(self, request):
        from mlxcel_plugin.engine_api import TokenEvent
        yield [TokenEvent(request.request_id, 0, 300), TokenEvent(request.request_id, 1, EOS,
                                                                 "stop")]


async def test_nodes_without_logprobs_give_empty_ones_not_an_error(text_tokenizer) -> None:
    app = make_app(OldNodes(), text_tokenizer, MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        chat = await c.post("/v1/chat/completions", json={"messages": USER, "logprobs": True})
        echo = await c.post("/v1/completions", json={"prompt": "a b", "echo": True,
                                                     "logprobs": 1})
    assert chat.json()["choices"][0]["logprobs"] == {"content": []}
    lp = echo.json()["choices"][0]["logprobs"]
    assert set(lp["token_logprobs"]) == {None} and set(lp["top_logprobs"]) == {None}
