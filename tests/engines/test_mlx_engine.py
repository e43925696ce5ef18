"""MlxEngine on the tiny model: exactness across roles, batching, events, failures."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from engines.mlx_engine import MlxEngine
from engines.plugin import make_mlx_engine
from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    CacheLayer,
    CacheState,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    prefill_rows,
)
from mlxcel_plugin.errors import ContextLengthError, InvalidRequestError
from mlxcel_plugin.plugins import load_plugins
from tests.conftest import REPO
from tests.engines import prefill_child, support

# Small chunks so the 255/256/257/600-token prompts cross chunk boundaries.
CHUNK = 256
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, min_p=0.01, seed=1234)
PENALIZED = SamplingParams(
    temperature=0.7,
    repetition_penalty=1.3,
    presence_penalty=0.5,
    frequency_penalty=0.2,
    seed=7,
)


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(3, 49152, n))


def request(rid: str, n: int, max_tokens: int = 16, **kwargs) -> GenerationRequest:
    return GenerationRequest(rid, prompt(n, seed=n), max_tokens, **kwargs)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = MlxEngine.from_path(str(tiny_model_path), EngineConfig(chunk_size_tokens=CHUNK))
    eng.start()
    yield eng
    eng.close()


def make_engine(path, **config) -> MlxEngine:
    eng = MlxEngine.from_path(str(path), EngineConfig(chunk_size_tokens=CHUNK, **config))
    eng.start()
    return eng


@pytest.mark.parametrize("n", [1, 255, 256, 257, 600])
def test_greedy_hybrid_equals_prefill_then_decode(engine, n):
    req = request(f"greedy-{n}", n)
    hybrid = support.generate(engine, req)
    assert hybrid.tokens == support.split(engine, req)
    assert [e.index for e in hybrid.events] == list(range(16))
    assert hybrid.last.finish_reason == FINISH_LENGTH


@pytest.mark.parametrize("params", [SEEDED, PENALIZED], ids=["seeded", "penalties"])
def test_seeded_sampling_same_on_one_node_or_two(engine, params):
    req = request("seeded", 40, max_tokens=24, sampling=params)
    hybrid = support.generate(engine, req).tokens
    assert hybrid == support.split(engine, req)
    assert hybrid == support.generate(engine, req).tokens
    other_seed = dataclasses.replace(req, sampling=dataclasses.replace(params, seed=99))
    assert support.generate(engine, other_seed).tokens != hybrid


def test_unseeded_sampling_varies(engine):
    req = request("unseeded", 12, max_tokens=12, sampling=SamplingParams(temperature=1.5))
    runs = {tuple(support.generate(engine, req).tokens) for _ in range(3)}
    assert len(runs) > 1


def test_decode_in_another_process_matches_hybrid(engine, tiny_model_path, tmp_path):
    req = request("xproc", 600, max_tokens=20, sampling=SEEDED)
    out = tmp_path / "kv.npz"
    payload = {
        "request_id": req.request_id,
        "prompt_tokens": list(req.prompt_tokens),
        "max_tokens": req.max_tokens,
        "sampling": req.sampling.to_dict(),
        "chunk_size_tokens": CHUNK,
    }
    subprocess.run(
        [sys.executable, "-m", "tests.engines.prefill_child", str(tiny_model_path), str(out)],
        input=json.dumps(payload),
        text=True,
        cwd=REPO,
        check=True,
        timeout=120,
    )
    first_token, cache = prefill_child.load_result(out)
    events = support.Events()
    engine.decode(req, first_token, cache, events)
    events.wait()
    assert [first_token, *events.tokens] == support.generate(engine, req).tokens


def test_requests_joining_a_running_batch_match_running_alone(engine):
    reqs = [request(f"join-{n}", n, max_tokens=30) for n in (5, 300, 37, 129, 2)]
    alone = [support.generate(engine, r).tokens for r in reqs]
    collectors = [support.Events() for _ in reqs]
    engine.generate(reqs[0], collectors[0])
    _wait_for_tokens(collectors[0], 5)
    for r, c in zip(reqs[1:3], collectors[1:3], strict=True):
        engine.generate(r, c)
    _wait_for_tokens(collectors[1], 3)
    # A handed-off cache joins the same running batch.
    handed = support.prefill(engine, reqs[3])
    engine.decode(reqs[3], handed.first_token, handed.cache, collectors[3])
    engine.generate(reqs[4], collectors[4])
    together = [c.wait() and c.tokens for c in collectors]
    together[3] = [handed.first_token, *together[3]]
    assert together == alone


def _wait_for_tokens(events: support.Events, n: int) -> None:
    deadline = time.monotonic() + support.WAIT_S
    while len(events.events) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(events.events)
        time.sleep(0.001)


def test_prefill_streams_layers_in_order_and_slices_to_offset(engine):
    req = request("layers", 300)
    outcome = support.PrefillOutcome()
    engine.prefill(req, outcome.on_done, outcome.on_layer)
    result = outcome.wait()
    info = engine.info.fingerprint
    assert outcome.layer_order == list(range(info["num_layers"]))
    layer = result.cache.layers[0]
    assert layer.kind == "KVCache" and layer.dtype == "float32" and layer.offset == 300
    assert layer.keys.shape == (1, info["kv_heads"], 300, info["head_dim"])


def test_max_tokens_one_ends_at_prefill(engine):
    req = request("one", 20, max_tokens=1)
    events = support.generate(engine, req).events
    assert len(events) == 1 and events[0].finish_reason == FINISH_LENGTH
    assert events[0].token_id is not None
    assert support.prefill(engine, req).finish_reason == FINISH_LENGTH


def test_stop_token_id_is_emitted_with_stop(engine):
    base = request("stop", 30, max_tokens=16)
    tokens = support.generate(engine, base).tokens
    stop_at = next(i for i in range(2, 16) if tokens[i] not in tokens[:i])
    req = dataclasses.replace(base, stop_token_ids=(tokens[stop_at],))
    events = support.generate(engine, req).events
    assert [e.token_id for e in events] == tokens[: stop_at + 1]
    assert [e.finish_reason for e in events[:-1]] == [None] * stop_at
    assert events[-1].finish_reason == FINISH_STOP


def test_model_eos_stops_and_counts(tiny_model_path):
    base = MlxEngine.from_path(str(tiny_model_path), EngineConfig(warmup=False))
    req = request("eos", 30, max_tokens=16)
    base.start()
    tokens = support.generate(base, req).tokens
    base.close()
    eos = tokens[3] if tokens[3] not in tokens[:3] else tokens[0]
    info = dataclasses.replace(base.info, eos_token_ids=(eos,))
    eng = MlxEngine(base.model, info, EngineConfig(warmup=False))
    eng.start()
    try:
        events = support.generate(eng, req).events
    finally:
        eng.close()
    assert events[-1].token_id == eos and events[-1].finish_reason == FINISH_STOP
    assert len(events) == tokens.index(eos) + 1


def test_cancel_frees_the_cache(engine):
    long = support.Events()
    engine.generate(request("cancel-me", 200, max_tokens=100_000), long)
    _wait_for_tokens(long, 3)
    assert engine.stats().active_sequences == 1 and engine.stats().kv_bytes > 0
    engine.cancel("cancel-me")
    long.wait()
    assert long.last.finish_reason == FINISH_CANCELLED and long.last.token_id is None
    assert [e.index for e in long.events] == list(range(len(long.events)))
    # What stays is the prompt's full chunks, kept by the prefix cache (inside the budget).
    _wait_until(lambda: engine.stats().kv_bytes == engine.stats().prefix_cache.cached_bytes)
    assert engine.stats().active_sequences == 0


def _wait_until(condition) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def test_unsupported_cache_kind_is_refused(engine):
    req = request("bad-kind", 10)
    good = support.prefill(engine, req)
    layers = [dataclasses.replace(layer, kind="QuantizedKVCache") for layer in good.cache.layers]
    events = support.Events()
    engine.decode(req, good.first_token, CacheState(layers), events)
    events.wait()
    assert events.last.finish_reason == FINISH_ERROR
    assert "QuantizedKVCache" in events.last.error


def test_mismatched_cache_shape_is_refused(engine):
    req = request("bad-shape", 10)
    good = support.prefill(engine, req)
    broken = [
        CacheLayer(layer.kind, layer.keys[:, :1], layer.values[:, :1], layer.dtype, layer.offset)
        for layer in good.cache.layers
    ]
    events = support.Events()
    engine.decode(req, good.first_token, CacheState(broken), events)
    assert events.wait()[-1].finish_reason == FINISH_ERROR


def test_a_step_that_fails_after_its_forward_fails_its_requests_not_the_engine(engine,
                                                                               monkeypatch):
    """Taking the rows (``advance``) raising once: that batch's requests end with an error
    and the engine thread goes on (it had died, leaving every stream hanging)."""
    real = engine._batch.advance
    calls = []

    def fails_once(rows, advance_one):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("rows and sequences out of step")
        return real(rows, advance_one)

    monkeypatch.setattr(engine._batch, "advance", fails_once)
    failed = support.generate(engine, request("advance-fails", 12))
    assert failed.last.finish_reason == FINISH_ERROR and "out of step" in failed.last.error
    served = support.generate(engine, request("after-it", 12, max_tokens=4))
    assert served.last.finish_reason != FINISH_ERROR and len(served.tokens) == 4


def test_too_long_prompt_fails_alone(engine):
    running = support.Events()
    ok = request("ok", 50, max_tokens=40)
    expected = support.generate(engine, ok).tokens
    engine.generate(ok, running)
    too_long = GenerationRequest("too-long", prompt(engine.info.context_length), 4)
    failed = support.generate(engine, too_long)
    assert failed.events == [failed.last] and failed.last.finish_reason == FINISH_ERROR
    assert "context" in failed.last.error
    outcome = support.PrefillOutcome()
    engine.prefill(too_long, outcome.on_done)
    assert isinstance(outcome.wait(), ContextLengthError)
    running.wait()
    assert running.tokens == expected


def test_max_sequences_refuses_extra_requests(tiny_model_path):
    eng = make_engine(tiny_model_path, max_sequences=1, max_batch_size=1, warmup=False)
    try:
        first = support.Events()
        eng.generate(request("held", 10, max_tokens=100_000), first)
        _wait_for_tokens(first, 1)
        refused = support.generate(eng, request("refused", 10))
        assert refused.last.finish_reason == FINISH_ERROR and "max_sequences" in refused.last.error
    finally:
        eng.close()
    assert first.last.finish_reason == FINISH_CANCELLED


def test_batch_size_limit_queues_instead_of_failing(tiny_model_path):
    eng = make_engine(tiny_model_path, max_batch_size=2, warmup=False)
    try:
        reqs = [request(f"bs-{i}", 10 + i, max_tokens=8) for i in range(5)]
        alone = [support.generate(eng, r).tokens for r in reqs]
        collectors = [support.Events() for _ in reqs]
        for r, c in zip(reqs, collectors, strict=True):
            eng.generate(r, c)
        assert [c.wait() and c.tokens for c in collectors] == alone
    finally:
        eng.close()


def test_failing_callback_does_not_stop_the_engine(engine):
    def broken(event):
        raise RuntimeError("consumer went away")

    engine.generate(request("broken", 10), broken)
    assert support.generate(engine, request("after-broken", 10)).last.finish_reason == FINISH_LENGTH


def test_invalid_handoff_prompt_length(engine):
    req = request("short", 10)
    good = support.prefill(engine, req)
    longer = dataclasses.replace(req, prompt_tokens=req.prompt_tokens + (5,))
    events = support.Events()
    engine.decode(longer, good.first_token, good.cache, events)
    assert events.wait()[-1].finish_reason == FINISH_ERROR


def test_prefill_error_is_an_exception_for_on_done(engine):
    outcome = support.PrefillOutcome()
    engine.prefill(GenerationRequest("empty", (), 4), outcome.on_done)
    assert isinstance(outcome.wait(), InvalidRequestError)


def test_close_cancels_pending_requests(tiny_model_path):
    eng = make_engine(tiny_model_path, warmup=False)
    events = support.Events()
    eng.generate(request("pending", 10, max_tokens=100_000), events)
    _wait_for_tokens(events, 1)
    eng.close()
    assert events.wait()[-1].finish_reason == FINISH_CANCELLED
    late = support.Events()
    eng.generate(request("late", 10), late)
    assert late.wait()[-1].finish_reason == FINISH_CANCELLED


def test_model_info(engine):
    info = engine.info
    layers = info.fingerprint.pop("layers")
    assert info.fingerprint == {
        "architecture": "llama",
        "num_layers": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "dtype": "float32",
        "cache_classes": ["KVCache"] * 4,
    }
    info.fingerprint["layers"] = layers
    # Described from the cache objects: K and V of [1, kv_heads, T, head_dim], T growing.
    kv = {"shape": [1, 2, 0, 16], "dtype": "float32", "grow_axis": 2, "coded": True}
    assert layers == [{"kind": "KVCache", "arrays": [{"name": "k", **kv}, {"name": "v", **kv}]}] * 4
    assert info.context_length == 2048 and info.eos_token_ids == (2,) and info.vocab_size == 49152


def test_registered_as_plugin(tiny_model_path):
    registry = load_plugins(env={"MLXCEL_PLUGINS": "mlx_engines"})
    assert registry.get("engine", "mlx") is make_mlx_engine


def test_prefill_hands_each_cells_rows_as_its_forward_ends(engine):
    """Rows come contiguous from token 0, cell by cell, equal to the final cache's; the last
    token goes alone (with the whole layer), so the rows end one short of the prompt."""
    req = GenerationRequest("rows", prompt(300, seed=4242), 16)  # no prefix cached for it
    outcome, rows = support.PrefillOutcome(), []
    assert prefill_rows(engine)
    engine.prefill(req, outcome.on_done, outcome.on_layer,
                   on_rows=lambda index, first, arrays: rows.append((index, first, arrays)))
    result = outcome.wait()
    layers = len(result.cache.layers)
    by_layer = [[(first, arrays) for index, first, arrays in rows if index == i]
                for i in range(layers)]
    for layer, cells in zip(result.cache.layers, by_layer, strict=True):
        ends = [first + arrays["k"].shape[2] for first, arrays in cells]
        assert [first for first, _ in cells] == [0, *ends[:-1]] and ends[-1] == 299
        assert len(cells) == -(-299 // CHUNK)
        for first, arrays in cells:
            end = first + arrays["k"].shape[2]
            assert np.array_equal(arrays["k"], layer.keys[:, :, first:end])
            assert np.array_equal(arrays["v"], layer.values[:, :, first:end])
