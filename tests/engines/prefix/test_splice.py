"""Delta handoffs on the tiny model: pin a cached prefix, splice the received rest, stay exact."""

from __future__ import annotations

import dataclasses

import pytest
from mlx_lm.models.cache import make_prompt_cache

from engines import kv_convert
from engines.mlx_engine import MlxEngine
from engines.prefill import run_prefill
from engines.prefix.cache import PrefixCache
from engines.prefix.splice import check_handoff, handoff_caches
from mlxcel_plugin.engine_api import (
    FINISH_ERROR,
    CacheState,
    EngineConfig,
    GenerationRequest,
    PrefillResult,
    PrefixCacheConfig,
    SamplingParams,
    release_prefix,
    reserve_prefix,
)
from mlxcel_plugin.errors import HandoffError
from tests.engines import support
from tests.engines.prefix.test_cache import CHUNK, SEEDED, SHARED, make_engine, tokens

HELD = 1024  # the full 256-token chunks of SHARED + 7 tokens that a handoff leaves cached


def delta_of(result: PrefillResult, prefix_tokens: int) -> CacheState:
    """What a delta handoff brings: positions [prefix_tokens, T) of every layer."""
    return CacheState([
        dataclasses.replace(layer, keys=layer.keys[:, :, prefix_tokens:],
                            values=layer.values[:, :, prefix_tokens:])
        for layer in result.cache.layers
    ])


def decode(engine, request: GenerationRequest, first: int, cache: CacheState) -> support.Events:
    events = support.Events()
    engine.decode(request, first, cache, events)
    events.wait()
    return events


@pytest.fixture(scope="module")
def cluster(tiny_model_path):
    """A prefill engine, a decode engine that received SHARED's handoff, a cache-off reference."""
    prefill, decode_node = (make_engine(tiny_model_path, 1 << 30) for _ in range(2))
    plain = make_engine(tiny_model_path, 0)
    first = GenerationRequest("first", SHARED + tokens(7, seed=2), 2)
    result = support.prefill(prefill, first)
    assert support.decode_after(decode_node, first, result)  # it keeps the prompt's full chunks
    yield prefill, decode_node, plain
    for engine in (prefill, decode_node, plain):
        engine.close()


@pytest.mark.parametrize("extra", [1, 255, 256, 257, 600])
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_a_spliced_delta_decodes_what_a_single_node_generates(cluster, extra, sampling):
    prefill, decode_node, plain = cluster
    request = GenerationRequest(f"d{extra}", SHARED + tokens(extra, seed=extra), 10, sampling)
    assert reserve_prefix(decode_node, request.request_id, request.prompt_tokens, HELD)
    result = support.prefill(prefill, request)
    events = decode(decode_node, request, result.first_token, delta_of(result, HELD))
    assert [result.first_token, *events.tokens] == support.generate(plain, request).tokens


def test_only_a_held_exact_prefix_can_be_reserved(cluster, tiny_model_path):
    _, decode_node, plain = cluster
    prompt = SHARED + tokens(300, seed=9)
    # Mid-chunk: exact only where the start-up probe allowed any-token reuse.
    any_token = decode_node.stats().prefix_cache.exact_min_rows > 0
    assert reserve_prefix(decode_node, "mid-chunk", prompt, HELD - 24) == any_token
    release_prefix(decode_node, "mid-chunk")
    assert not reserve_prefix(decode_node, "too-long", prompt, HELD + CHUNK)  # not held
    assert not reserve_prefix(decode_node, "other", tokens(1400, seed=77), HELD)
    assert not reserve_prefix(decode_node, "whole", SHARED[:HELD], HELD)  # nothing left to send
    assert not reserve_prefix(plain, "off", prompt, HELD)  # cache off: never
    assert reserve_prefix(decode_node, "shorter", prompt, CHUNK)  # any held chunk boundary
    release_prefix(decode_node, "shorter")


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_a_mid_chunk_delta_is_exact_on_an_any_token_grid(cluster, sampling):
    prefill, decode_node, plain = cluster
    if not decode_node.stats().prefix_cache.exact_min_rows:
        pytest.skip("this backend reuses whole chunks only (engines/prefix/reuse_probe.py)")
    held = len(SHARED)  # mid-chunk: what this prompt shares with the first handoff's
    request = GenerationRequest("mid", SHARED + tokens(120, seed=12), 10, sampling)
    assert reserve_prefix(decode_node, request.request_id, request.prompt_tokens, held)
    result = support.prefill(prefill, request)
    events = decode(decode_node, request, result.first_token, delta_of(result, held))
    assert [result.first_token, *events.tokens] == support.generate(plain, request).tokens


def test_a_delta_without_its_pin_fails_only_its_request(cluster):
    prefill, decode_node, plain = cluster
    request = GenerationRequest("released", SHARED + tokens(40, seed=41), 6)
    assert reserve_prefix(decode_node, request.request_id, request.prompt_tokens, HELD)
    release_prefix(decode_node, request.request_id)
    result = support.prefill(prefill, request)
    events = decode(decode_node, request, result.first_token, delta_of(result, HELD))
    assert [(e.index, e.finish_reason) for e in events.events] == [(1, FINISH_ERROR)]
    assert "after a prefix" not in events.last.error  # no pin: a plain shape refusal
    again = dataclasses.replace(request, request_id="released-2")
    assert reserve_prefix(decode_node, again.request_id, again.prompt_tokens, HELD)
    events = decode(decode_node, again, result.first_token, delta_of(result, HELD))
    assert [result.first_token, *events.tokens] == support.generate(plain, request).tokens


def test_a_cancel_releases_the_pin(cluster):
    prefill, decode_node, _ = cluster
    request = GenerationRequest("cancelled", SHARED + tokens(20, seed=42), 6)
    result = support.prefill(prefill, request)
    assert reserve_prefix(decode_node, request.request_id, request.prompt_tokens, HELD)
    decode_node.cancel(request.request_id)  # queued before the decode: the pin is gone by then
    events = decode(decode_node, request, result.first_token, delta_of(result, HELD))
    assert [(e.index, e.finish_reason) for e in events.events] == [(1, FINISH_ERROR)]


def test_a_pinned_prefix_survives_eviction_and_still_counts(tiny_model_path):
    engine = MlxEngine.from_path(str(tiny_model_path), EngineConfig(
        chunk_size_tokens=CHUNK, prefix_cache=PrefixCacheConfig(max_bytes=1 << 30), warmup=False))
    cache = PrefixCache(1 << 30, CHUNK)
    prompt = SHARED + tokens(7, seed=2)
    caches = make_prompt_cache(engine.model)
    run_prefill(engine.model, prompt, caches, CHUNK)
    cache.store_prompt(prompt, caches)
    stored = cache.nbytes
    assert cache.pin("r", SHARED + tokens(30, seed=3), HELD)
    assert cache.evict_to(0) == 0  # the pinned entry left the LRU, its memory did not
    assert cache.stats().entries == 0 and cache.nbytes == stored
    pin = cache.take_pin("r")
    assert pin is not None and cache.nbytes == 0
    # Spliced in front of the rest of a prefill, it is that prefill's own cache.
    full = kv_convert.to_cache_state(caches)
    delta = CacheState([dataclasses.replace(layer, keys=layer.keys[:, :, HELD:],
                                            values=layer.values[:, :, HELD:])
                        for layer in full.layers])
    check_handoff(delta, engine.info.fingerprint, len(prompt), pin)
    spliced = kv_convert.to_cache_state(handoff_caches(delta, pin))
    for got, want in zip(spliced.layers, full.layers, strict=True):
        assert (got.keys == want.keys).all() and (got.values == want.values).all()
    with pytest.raises(HandoffError, match="after a prefix of 1024"):
        check_handoff(full, engine.info.fingerprint, len(prompt), pin)
