"""A real hybrid server process on 127.0.0.1, driven by the official ``openai`` SDK.

The tiny random checkpoint produces gibberish, but deterministic gibberish
(greedy): stop strings are cut from text the server produced before, and
concurrency is checked against sequential results. The reasoning split needs
a model that writes ``<think>`` tags; it is covered over a fake engine in
``tests/router_plugin/http/test_front.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.local_cluster import start_node
from mlxcel_plugin.text import TextTokenizer

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180
MESSAGES = [{"role": "user", "content": "Write a short story about a fox."}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_path) -> str:
    return str(tiny_model_path)


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    flags = ["--model", model_dir, "--served-model-name", "tiny"]
    node = start_node("hybrid", tmp_path_factory.mktemp("hybrid"), flags)
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        yield node.url
    finally:
        node.stop()


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> TextTokenizer:
    return TextTokenizer.from_dir(model_dir)


def chat_prompt_tokens(tokenizer: TextTokenizer, messages=MESSAGES) -> int:
    return len(tokenizer.encode_chat(tokenizer.render_chat(messages)))


def stream_chat_text(client: openai.OpenAI, **kwargs) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        **kwargs,
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_models_and_health(server: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_chat_non_streaming_and_streaming_agree(client, tokenizer) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24)
    assert r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == chat_prompt_tokens(tokenizer)
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    text, finish, usage = stream_chat_text(client, max_tokens=24)
    assert text == r.choices[0].message.content and finish == "length"
    assert usage.model_dump() == r.usage.model_dump()


def test_completions(client, tokenizer) -> None:
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16)
    assert r.id.startswith("cmpl-") and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    assert r.usage.completion_tokens == 16
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time",
                                            max_tokens=16, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_stop_strings(client) -> None:
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    for kwargs in ({"stop": stop}, {"stop": ["\x00never", stop]}):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                           **kwargs)  # fmt: skip
        assert r.choices[0].message.content == expected
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 40
        streamed, finish, _ = stream_chat_text(client, max_tokens=40, **kwargs)
        assert (streamed, finish) == (expected, "stop")


def test_sampling_parameters_are_accepted(client) -> None:
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.8, top_p=0.9,
                  seed=3, presence_penalty=0.1, frequency_penalty=0.1,
                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})  # fmt: skip
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert a.usage.completion_tokens == 8
    assert a.choices[0].message.content == b.choices[0].message.content  # seeded


def test_eight_concurrent_streams_equal_sequential(server: str) -> None:
    prompts = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(8)]

    async def one(c: openai.AsyncOpenAI, messages) -> str:
        stream = await c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, stream=True
        )
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def run() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none",
                                      max_retries=0, timeout=120) as c:  # fmt: skip
            sequential = [await one(c, m) for m in prompts]
            concurrent = await asyncio.gather(*(one(c, m) for m in prompts))
            return sequential, list(concurrent)

    sequential, concurrent = asyncio.run(run())
    assert concurrent == sequential
    assert len(set(sequential)) > 1


def _metric(server: str, name: str) -> float:
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_disconnect_cancels_generation(server: str) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1900, "stream": True}
    before = _metric(server, 'mlxcel:request_errors_total{code="cancelled"')
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _metric(server, 'mlxcel:request_errors_total{code="cancelled"') > before:
            break
        time.sleep(0.1)
    assert _metric(server, 'mlxcel:request_errors_total{code="cancelled"') == before + 1
    assert _metric(server, "mlxcel:num_requests_running") == 0


def test_metrics_exposed(server: str) -> None:
    text = httpx.get(f"{server}/metrics").text
    names = ("time_to_first_token_seconds", "inter_token_latency_seconds",
             "e2e_request_latency_seconds", "generation_tokens_total")  # fmt: skip
    for name in names:
        assert f"mlxcel:{name}" in text


BAD_CHAT = [
    ({"messages": "hi"}, 400),
    ({"messages": []}, 400),
    ({"messages": MESSAGES, "max_tokens": 0}, 400),
    ({"messages": MESSAGES, "max_tokens": 1.5}, 400),
    ({"messages": MESSAGES, "max_tokens": "ten"}, 400),
    ({"messages": MESSAGES, "temperature": "hot"}, 400),
    ({"messages": MESSAGES, "n": 2}, 400),
    ({"messages": MESSAGES, "response_format": {"type": "yaml"}}, 400),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {}}}, 400),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400),
    ({"messages": MESSAGES, "model": "no-such-model"}, 404),
]


@pytest.mark.parametrize(("body", "status"), BAD_CHAT)
def test_bad_chat_inputs_are_openai_errors(server: str, body: dict, status: int) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_bad_inputs_through_the_sdk(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="word " * 3000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="")


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"model": "tiny"}', b"\xff\xfe"])
def test_malformed_bodies(server: str, raw: bytes) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_server_still_serves_after_bad_inputs(client) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert r.usage.completion_tokens == 4
