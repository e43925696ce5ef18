"""Completion: one request's state on the front, read through its own small surface."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel_plugin.engine_api import FINISH_ERROR, TokenEvent
from mlxcel_plugin.errors import NodeLostError
from router_plugin.http.completion import Completion
from router_plugin.http.front import OpenAIFront
from router_plugin.http.metrics import FrontMetrics
from router_plugin.http.openai_schema import parse_chat_request
from tests.router_plugin.http.test_front import EOS, MODEL, USER, ScriptedBackend


def plan(text_tokenizer, backend: ScriptedBackend, **body) -> Completion:
    front = OpenAIFront(backend, text_tokenizer, MODEL, context_length=None,
                        system_fingerprint=None, metrics=FrontMetrics(MODEL))
    return front.plan_chat(parse_chat_request({"messages": USER, **body}), 0.0)


def texts(completion: Completion) -> str:
    async def main() -> str:
        return "".join([d.content async for d in completion.deltas()])

    return asyncio.run(main())


def test_usage_and_finish_reason_come_from_the_completion(text_tokenizer) -> None:
    ids = text_tokenizer.encode("a b c", add_special_tokens=False) + [EOS]
    backend = ScriptedBackend([TokenEvent("x", i, t) for i, t in enumerate(ids)])
    completion = plan(text_tokenizer, backend, stream=True,
                      stream_options={"include_usage": True})
    assert completion.stream and completion.include_usage and not completion.done
    assert texts(completion) == "a b c"
    assert completion.done and completion.finish_reason == "stop" and backend.closed
    prompt = len(completion.request.prompt_tokens)
    assert completion.usage() == {"prompt_tokens": prompt, "completion_tokens": len(ids),
                                  "total_tokens": prompt + len(ids),
                                  "prompt_tokens_details": {"cached_tokens": 0}}
    completion.raise_if_failed()  # a clean finish raises nothing


def test_budget_closes_the_backend_stream(text_tokenizer) -> None:
    ids = text_tokenizer.encode("a b c d e f", add_special_tokens=False)
    backend = ScriptedBackend([TokenEvent("x", i, t) for i, t in enumerate(ids)])
    completion = plan(text_tokenizer, backend, max_tokens=2)
    assert texts(completion) == "a b"
    assert completion.finish_reason == "length" and completion.usage()["completion_tokens"] == 2
    assert backend.closed


def test_a_stream_that_breaks_off_is_a_lost_node(text_tokenizer) -> None:
    completion = plan(text_tokenizer, ScriptedBackend([TokenEvent("x", 0, 100)]))
    texts(completion)
    assert completion.finish_reason == FINISH_ERROR
    with pytest.raises(NodeLostError):
        completion.raise_if_failed()


def test_usage_reports_the_cached_tokens_of_the_first_event(text_tokenizer) -> None:
    ids = text_tokenizer.encode("a b", add_special_tokens=False) + [EOS]
    events = [TokenEvent("x", i, t, cached_tokens=512 if i == 0 else 0) for i, t in enumerate(ids)]
    completion = plan(text_tokenizer, ScriptedBackend(events), stream=False)
    assert texts(completion) == "a b"
    assert completion.usage()["prompt_tokens_details"] == {"cached_tokens": 512}
