"""The node roles' sans-I/O pieces: request checks, metrics, fake engine."""

from __future__ import annotations

import threading

import pytest

from mlxcel_plugin.engine_api import CacheState, GenerationRequest, SamplingParams
from mlxcel_plugin.errors import EngineError, InvalidRequestError
from mlxcel_plugin.link.protocol.frames import Request
from mlxcel_plugin.nodes.metrics import DecodeMetrics
from mlxcel_plugin.nodes.requests import generation_request, sampling_params
from mlxcel_plugin.testing.fake_engine import (
    FakeEngine,
    FakeEngineSettings,
    expected_tokens,
    make_layer,
    prompt_from_cache,
)


def test_request_fields_are_checked():
    request = generation_request(Request("r", [1, 2], {"temperature": 0.5, "seed": 3}, 4, [9]))
    assert request.sampling == SamplingParams(temperature=0.5, seed=3)
    assert request.stop_token_ids == (9,)
    assert generation_request(Request("c", [], claim=True)).prompt_tokens == ()
    for bad in (Request("r", []), Request("r", [1], max_tokens=0)):
        with pytest.raises(InvalidRequestError):
            generation_request(bad)
    for sampling in ({"temperature": "hot"}, {"seed": 1.5}, {"top_k": True}):
        with pytest.raises(InvalidRequestError):
            sampling_params(sampling)


def test_decode_metrics_use_mlxcel_names():
    metrics = DecodeMetrics(lambda: 2, lambda: 3, lambda: 100, lambda: 50)
    metrics.tpot.observe(0.01)
    text = metrics.render()[0].decode()
    for name in ("mlxcel:time_per_output_token_seconds_count 1.0",
                 "mlxcel:decode_ingestion_queue_depth 2.0", "mlxcel:decode_batch_size 3.0",
                 "mlxcel:kv_cache_bytes 100.0"):
        assert name in text


def test_fake_cache_encodes_the_prompt_and_detects_damage():
    settings = FakeEngineSettings()
    layers = [make_layer((5, 6, 7), i, settings) for i in range(settings.num_layers)]
    assert prompt_from_cache(CacheState(layers)) == (5, 6, 7)
    layers[2].keys[0, 1, 0, 3] = 0.5
    with pytest.raises(EngineError):
        prompt_from_cache(CacheState(layers))


def collect(engine: FakeEngine, call) -> list:
    events, done = [], threading.Event()

    def emit(event):
        events.append(event)
        if event.finish_reason is not None:
            done.set()

    call(emit)
    assert done.wait(5)
    return events


def test_fake_engine_split_run_equals_generate():
    engine = FakeEngine(FakeEngineSettings())
    engine.start()
    try:
        request = GenerationRequest("r", (4, 5, 6), 6, SamplingParams(temperature=1.0, seed=9))
        whole = collect(engine, lambda emit: engine.generate(request, emit))
        results, layers, done = [], [], threading.Event()
        engine.prefill(request, lambda r: (results.append(r), done.set()),
                       lambda i, layer: layers.append(i))
        assert done.wait(5)
        first = results[0]
        rest = collect(engine, lambda emit: engine.decode(request, first.first_token,
                                                          first.cache, emit))
    finally:
        engine.close()
    tokens = [first.first_token] + [e.token_id for e in rest if e.token_id is not None]
    assert tokens == [e.token_id for e in whole] == expected_tokens(request)
    assert layers == [0, 1, 2, 3] and rest[0].index == 1
