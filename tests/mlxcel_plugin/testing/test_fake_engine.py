"""The one fake engine: its scripted mode (front tests) beside its model mode (node tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineConfig,
    GenerationRequest,
    TokenEvent,
)
from mlxcel_plugin.testing.fake_autoregressive import make_fake_engine
from mlxcel_plugin.testing.fake_engine import FakeEngine, Script

EOS = 2


@pytest.fixture
def scripted() -> Iterator[Callable[..., FakeEngine]]:
    engines: list[FakeEngine] = []

    def make(script: Script, **kwargs) -> FakeEngine:
        engines.append(FakeEngine.scripted(script, **kwargs))
        engines[-1].start()
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def run(engine: FakeEngine, request: GenerationRequest) -> list[TokenEvent]:
    events, done = [], threading.Event()

    def emit(event: TokenEvent) -> None:
        events.append(event)
        if event.finish_reason is not None:
            done.set()

    engine.generate(request, emit)
    assert done.wait(5)
    return events


def shape(events: list[TokenEvent]) -> list[tuple[int, int | None, str | None]]:
    return [(e.index, e.token_id, e.finish_reason) for e in events]


def test_a_script_is_replied_token_by_token_and_stops_after_its_last(scripted):
    engine = scripted(lambda request: [7, 8, 9])
    request = GenerationRequest("r", (40, 41), 10)
    assert shape(run(engine, request)) == [(0, 7, None), (1, 8, None), (2, 9, FINISH_STOP)]
    assert engine.requests == [request] and engine.cancelled == []


def test_max_tokens_cuts_a_script_short(scripted):
    engine = scripted(lambda request: [7, 8, 9])
    events = run(engine, GenerationRequest("r", (40,), 2))
    assert shape(events) == [(0, 7, None), (1, 8, FINISH_LENGTH)]


def test_eos_or_a_stop_token_in_the_script_ends_the_reply(scripted):
    engine = scripted(lambda request: [7, 5, 8, EOS, 9])
    assert shape(run(engine, GenerationRequest("a", (40,), 10)))[-1] == (3, EOS, FINISH_STOP)
    events = run(engine, GenerationRequest("b", (40,), 10, stop_token_ids=(5,)))
    assert shape(events) == [(0, 7, None), (1, 5, FINISH_STOP)]


def test_an_empty_script_ends_at_once_without_a_token(scripted):
    engine = scripted(lambda request: [])
    assert shape(run(engine, GenerationRequest("r", (40,), 10))) == [(0, None, FINISH_STOP)]


def test_the_script_sees_the_request_and_prompt_ids_up_to_smollm2_vocabulary(scripted):
    engine = scripted(lambda request: [t + 1 for t in request.prompt_tokens], context_length=64)
    events = run(engine, GenerationRequest("r", (49000, 3), 10))
    assert [e.token_id for e in events] == [49001, 4]
    assert engine.info.context_length == 64 and engine.info.vocab_size == 49152


def test_a_cancel_is_recorded_and_ends_the_reply(scripted):
    engine = scripted(lambda request: [7] * 10_000, token_delay_s=0.001)
    events, done = [], threading.Event()
    engine.generate(GenerationRequest("r", (40,), 10_000),
                    lambda e: (events.append(e), e.finish_reason and done.set()))
    engine.cancel("r")
    assert done.wait(5)
    assert events[-1].finish_reason == FINISH_CANCELLED and events[-1].token_id is None
    assert engine.cancelled == ["r"] and engine.live_ids() == []


def test_a_cancel_of_an_unknown_request_is_not_recorded(scripted):
    engine = scripted(lambda request: [7])
    run(engine, GenerationRequest("r", (40,), 10))
    engine.cancel("gone")
    run(engine, GenerationRequest("s", (40,), 10))  # the cancel was handled before this
    assert engine.cancelled == []


def test_a_scripted_prefill_then_decode_replies_like_generate(scripted):
    engine = scripted(lambda request: [7, 8, 9])
    request = GenerationRequest("r", (40, 41), 10)
    results, done = [], threading.Event()
    engine.prefill(request, lambda result: (results.append(result), done.set()))
    assert done.wait(5)
    rest, finished = [], threading.Event()
    engine.decode(request, results[0].first_token, results[0].cache,
                  lambda e: (rest.append(e), e.finish_reason and finished.set()))
    assert finished.wait(5)
    assert [results[0].first_token] + [e.token_id for e in rest] == [7, 8, 9]
    assert len(engine.requests) == 2


def test_the_registered_factory_builds_a_model_engine_without_a_script():
    engine = make_fake_engine(None, EngineConfig())
    assert engine.script is None and engine.info.vocab_size == 1000
