"""Leaf caches described and rebuilt: CacheList nesting, SSM state, quantized K/V (kv_bits=8)."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, make_prompt_cache
from mlx_lm.utils import _get_classes

from engines import cache_layout, kv_convert, model_loader
from engines.decode_batch import DecodeBatch, Sequence
from engines.prefill import run_prefill
from engines.tiny_models import tiny_config
from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import CacheState
from mlxcel_plugin.kv_serde import ModelFingerprint, SerializableCacheState, assemble_messages
from mlxcel_plugin.kv_serde.layer_spec import LayerSpec
from mlxcel_plugin.testing.caches import make_header


def ssm_cache() -> ArraysCache:
    cache = ArraysCache(2)
    cache[0] = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    cache[1] = mx.ones((1, 2, 4, 3), dtype=mx.bfloat16)
    return cache


def test_a_cache_list_is_one_handoff_layer_per_cache_and_nests_back():
    kv, ssm = KVCache(), ssm_cache()
    caches = [CacheList(ssm, kv), KVCache()]
    flat = cache_layout.leaves(caches)
    assert flat == [ssm, kv, caches[1]]
    rebuilt = cache_layout.nest(flat, cache_layout.nesting(caches))
    assert isinstance(rebuilt[0], CacheList) and list(rebuilt[0].caches) == [ssm, kv]


def test_ssm_state_is_fixed_size_raw_and_rebuilds_exactly():
    cache = ssm_cache()
    spec = cache_layout.describe_leaf(cache)
    assert [(a.name, a.shape, a.grow_axis, a.coded) for a in spec.arrays] == [
        ("s0", (1, 3, 4), None, False), ("s1", (1, 2, 4, 3), None, False)]
    layer = kv_convert.to_cache_layer(cache, prompt_len=57)
    assert layer.offset == 57 and layer.keys is None and layer.extra["s1"].dtype == np.uint16
    rebuilt = kv_convert.from_cache_layer(layer)
    assert isinstance(rebuilt, ArraysCache) and rebuilt[1].dtype == mx.bfloat16
    assert all(mx.array_equal(a, b).item() for a, b in zip(rebuilt.cache, cache.cache, strict=True))


def _greedy(model, caches: list, first: int, steps: int) -> list[int]:
    batch = DecodeBatch(model)
    batch.add([Sequence(None, None, None, last_token=first, num_generated=1)], [caches])
    tokens = []
    for _ in range(steps):
        token = int(np.argmax(batch.step()[0]))
        batch.sequences[0].last_token = token
        tokens.append(token)
    return tokens


def llama_with_head_dim_32() -> nn.Module:
    """mx.quantize needs groups of 32+ along head_dim; the tiny checkpoint's is 16."""
    config = tiny_config("llama", {"vocab_size": 512}) | {"head_dim": 32}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    return model_class(args_class.from_dict(config))


def test_quantized_kv_cache_goes_over_the_wire_packed_and_decodes_the_same():
    """kv_bits=8: packed words, scales and biases shipped as they are, decode unchanged."""
    model = llama_with_head_dim_32()
    prompt = list(range(100, 190))
    caches = make_prompt_cache(model)
    logits = run_prefill(model, prompt, caches, 32)
    quantized = [c.to_quantized(group_size=32, bits=8) for c in caches]
    mx.eval([c.state[:2] for c in quantized])
    specs = tuple(cache_layout.describe_leaf(c) for c in quantized)
    assert specs[0].names == ("k", "k.scales", "k.biases", "v", "v.scales", "v.biases")
    assert not any(a.coded for a in specs[0].arrays)  # a lossy codec never touches them
    fingerprint = ModelFingerprint("llama", len(specs), 0, 0, "float32",
                                   tuple(s.kind for s in specs), layers=specs)
    cache = kv_convert.to_cache_state(quantized)
    header = make_header(fingerprint, len(prompt), codec="int8")
    messages = SerializableCacheState(header, cache).to_messages(builtin_codecs()["int8"])
    received = assemble_messages(messages, fingerprint, builtin_codecs()).cache
    first = int(mx.argmax(logits).item())
    expected = _greedy(model, quantized, first, 6)
    assert _greedy(model, kv_convert.from_cache_state(received), first, 6) == expected


def test_a_model_with_a_kind_that_cannot_travel_starts_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(model_loader, "describe_model",
                        lambda model: [LayerSpec("MysteryCache", ())])
    monkeypatch.setattr(model_loader, "activation_dtype", lambda model: mx.float32)
    with caplog.at_level(logging.WARNING, logger="engines.model_loader"):
        fingerprint = model_loader.cache_fingerprint(object(), "llama4")
    assert "cannot run disaggregated" in caplog.text and "MysteryCache" in caplog.text
    assert ModelFingerprint.from_dict(fingerprint).cache_classes == ("MysteryCache",)


def test_a_chunked_cache_keeps_its_window_start():
    cache = ChunkedKVCache(chunk_size=8)
    for _ in range(3):
        cache.update_and_fetch(mx.ones((1, 1, 5, 4)), mx.ones((1, 1, 5, 4)))
        cache.maybe_trim_front()
    layer = kv_convert.to_cache_layer(cache)
    assert layer.meta == {"chunk_size": 8, "start_position": 7} and layer.keys.shape[2] == 8
    rebuilt = kv_convert.from_cache_layer(layer)
    assert (rebuilt.offset, rebuilt.start_position) == (15, 7)
    assert mx.array_equal(rebuilt.keys_and_values()[0], cache.keys_and_values()[0]).item()


def test_cache_state_of_a_hybrid_model_lists_leaves():
    caches = [CacheList(ssm_cache(), KVCache())]
    caches[0].caches[1].update_and_fetch(mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 4, 8)))
    state = kv_convert.to_cache_state(caches, prompt_len=4)
    assert [layer.kind for layer in state.layers] == ["ArraysCache", "KVCache"]
    rebuilt = kv_convert.from_cache_state(CacheState(state.layers), [2])
    assert isinstance(rebuilt[0], CacheList) and rebuilt[0].caches[1].offset == 4
