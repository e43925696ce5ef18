"""Property: whatever JSON a client sends, the front answers 2xx or an OpenAI-shaped 4xx.

Bodies are drawn around the request schema (``/openapi.json``): every known
field absent, valid, at its edges or replaced by arbitrary JSON. Properties:
no 5xx; each error OpenAI-shaped; a body the schema refuses is a 4xx (the
parser is at least as strict as the schema it publishes); a 200 matches its
response model. Bounded examples, so it runs in seconds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mlxcel_plugin.testing.fake_engine import FakeEngine
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app

MODEL = "tiny"
INT64 = 2**63

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
                | st.floats(allow_nan=False, allow_infinity=False))  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)  # fmt: skip


def either(valid: st.SearchStrategy) -> st.SearchStrategy:
    # Mostly plausible (so some bodies pass and reach the engine), sometimes anything.
    return st.integers(0, 9).flatmap(lambda pick: json_values if pick == 0 else valid)


def edged(valid: st.SearchStrategy, edges: list) -> st.SearchStrategy:
    return st.integers(0, 5).flatmap(lambda pick: st.sampled_from(edges) if pick == 0 else valid)


ints = edged(st.integers(1, 8), [-2, -1, 0, INT64 - 1, INT64, -INT64, -INT64 - 1, 10**30])
unit = edged(st.floats(0.1, 1.0), [-0.5, 0, 1, 2, 2.5, 1e308, -1e-300])
text_part = st.fixed_dictionaries({"type": either(st.just("text")), "text": either(st.text())})
message = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
     "content": either(st.text(max_size=40) | st.lists(text_part, max_size=2))},
    optional={
        "name": either(st.text(max_size=5)),
        "tool_call_id": either(st.text(max_size=5)),
        "tool_calls": either(st.lists(st.fixed_dictionaries(
            {"function": either(st.fixed_dictionaries({"name": st.text(max_size=5),
                                                       "arguments": st.text(max_size=9)}))}),
            max_size=2)),
    },
)  # fmt: skip
tool = st.fixed_dictionaries({"type": either(st.just("function")), "function": either(
    st.fixed_dictionaries({"name": either(st.text(max_size=5))},
                          optional={"parameters": json_values}))})  # fmt: skip
common = {
    "model": either(st.just(MODEL)),
    "max_tokens": either(ints),
    "temperature": either(unit),
    "top_p": either(unit),
    "top_k": either(ints),
    "min_p": either(unit),
    "repetition_penalty": either(unit),
    "presence_penalty": either(unit),
    "frequency_penalty": either(unit),
    "seed": either(ints),
    "stop": either(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3)),
    "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries({}, optional={
        "include_usage": either(st.booleans())})),
    "n": either(st.just(1)),
    "user": either(st.text(max_size=5)),
    "logprobs": either(st.none() | st.just(False)),
}  # fmt: skip
chat_only = {
    "max_completion_tokens": either(ints),
    "tools": either(st.lists(tool, max_size=2)),
    "tool_choice": either(st.sampled_from(["auto", "none"])),
    "chat_template_kwargs": either(st.just({})),
    "response_format": either(st.just({"type": "text"})),
}
chat_body = st.fixed_dictionaries(
    {"messages": either(st.lists(message, min_size=1, max_size=3))},
    optional={**common, **chat_only},
)
completion_body = st.fixed_dictionaries(
    {"prompt": either(st.text(max_size=40) | st.lists(st.integers(-1, 50_000), max_size=4)
                      | st.lists(st.text(max_size=9), max_size=2))},
    optional={**common, "best_of": either(st.just(1)), "echo": either(st.just(False)),
              "suffix": either(st.none())},
)  # fmt: skip


class Harness:
    def __init__(self, tokenizer):
        ids = tokenizer.encode("fine", add_special_tokens=False) + [2]
        self.engine = FakeEngine.scripted(lambda request: ids)
        self.engine.start()
        self.app = make_app(LocalEngineBackend(self.engine), tokenizer, MODEL)
        self.loop = asyncio.new_event_loop()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(self.app),
                                        base_url="http://t")  # fmt: skip
        schema = self.run(self.client.get("/openapi.json")).json()
        self.components = schema["components"]

    def run(self, work):
        return self.loop.run_until_complete(work)

    def validator(self, name: str) -> jsonschema.Validator:
        root = {"$ref": f"#/components/schemas/{name}", "components": self.components}
        return jsonschema.Draft202012Validator(root)

    def close(self) -> None:
        self.run(self.client.aclose())
        self.loop.close()
        self.engine.close()


@pytest.fixture(scope="module")
def harness(text_tokenizer) -> Iterator[Harness]:
    h = Harness(text_tokenizer)
    yield h
    h.close()


def check(harness: Harness, path: str, body: dict, request_model: str, reply_model: str) -> None:
    raw = json.dumps(body).encode()  # non-finite floats stay out: json_values draws none
    response = harness.run(harness.client.post(path, content=raw,
                                               headers={"content-type": "application/json"}))
    assert response.status_code < 500, (body, response.text)
    event(f"status {response.status_code}")  # --hypothesis-show-statistics: the mix
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return
    assert harness.validator(request_model).is_valid(body), ("schema refuses, server took", body)
    if body.get("stream") is True:
        frames = [f for f in response.text.split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        chunk = "ChatCompletionChunk" if reply_model == "ChatCompletion" else reply_model
        for frame in frames[:-1]:
            harness.validator(chunk).validate(json.loads(frame.removeprefix("data: ")))
    else:
        harness.validator(reply_model).validate(response.json())


FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])  # fmt: skip


@FUZZ
@given(body=chat_body)
def test_chat_bodies_never_5xx(harness: Harness, body: dict) -> None:
    check(harness, "/v1/chat/completions", body, "ChatCompletionRequest", "ChatCompletion")


@FUZZ
@given(body=completion_body)
def test_completion_bodies_never_5xx(harness: Harness, body: dict) -> None:
    check(harness, "/v1/completions", body, "CompletionRequest", "TextCompletion")


@settings(max_examples=100, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_never_5xx(harness: Harness, raw: bytes) -> None:
    response = harness.run(harness.client.post("/v1/chat/completions", content=raw))
    assert response.status_code < 500, (raw, response.text)
