"""The fake engine's autoregressive mode: a longer prompt continues a shorter one exactly."""

from __future__ import annotations

import json
import threading

from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams, TokenEvent
from mlxcel_plugin.testing.fake_autoregressive import (
    AutoregressiveFakeEngine,
    autoregressive_tokens,
    make_fake_engine,
)
from mlxcel_plugin.testing.fake_engine import FakeEngine
from mlxcel_plugin.testing.fake_model import expected_tokens

SEEDED = SamplingParams(temperature=0.7, seed=11)


def generate(engine: FakeEngine, request: GenerationRequest) -> list[int]:
    events: list[TokenEvent] = []
    done = threading.Event()

    def emit(event: TokenEvent) -> None:
        events.append(event)
        if event.finish_reason is not None:
            done.set()

    engine.generate(request, emit)
    assert done.wait(5)
    return [e.token_id for e in events if e.token_id is not None]


def prefill_then_decode(prefill: FakeEngine, decode: FakeEngine,
                        request: GenerationRequest) -> list[int]:
    results, done = [], threading.Event()
    prefill.prefill(request, lambda result: (results.append(result), done.set()))
    assert done.wait(5)
    rest, finished = [], threading.Event()
    decode.decode(request, results[0].first_token, results[0].cache,
                  lambda e: (rest.append(e), e.finish_reason and finished.set()))
    assert finished.wait(5)
    return [results[0].first_token] + [e.token_id for e in rest if e.token_id is not None]


def test_the_knob_picks_the_engine(tmp_path):
    (tmp_path / "fake_engine.json").write_text(json.dumps({"autoregressive": True}))
    assert type(make_fake_engine(str(tmp_path), EngineConfig())) is AutoregressiveFakeEngine
    assert type(make_fake_engine(None, EngineConfig())) is FakeEngine


def test_prompt_plus_streamed_tokens_continues_the_stream_exactly():
    prefill, decode = AutoregressiveFakeEngine(), AutoregressiveFakeEngine()
    for engine in (prefill, decode):
        engine.start()
    try:
        for sampling in (SamplingParams(), SEEDED):
            whole = GenerationRequest("r", (40, 41, 42), 12, sampling)
            expected = autoregressive_tokens(whole)
            assert generate(prefill, whole) == expected
            assert prefill_then_decode(prefill, decode, whole) == expected
            for k in (1, 5):
                resumed = GenerationRequest(f"r{k}", (40, 41, 42, *expected[:k]), 12 - k,
                                            sampling)
                assert prefill_then_decode(prefill, decode, resumed) == expected[k:]
            # The plain model only agrees on the first token (a longer prompt starts afresh).
            assert expected_tokens(whole)[0] == expected[0]
            assert expected_tokens(whole) != expected
        assert decode._contexts == {} and prefill._contexts == {}
    finally:
        prefill.close()
        decode.close()
