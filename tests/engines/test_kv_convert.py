"""Per-sequence mlx-lm caches <-> numpy CacheLayer: lossless, and refused when unsupported."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engines import kv_convert
from engines.decode_batch import DecodeBatch, Sequence
from engines.model_loader import load_mlx_model
from engines.prefill import run_prefill
from engines.unfilled import SlabCarver
from mlxcel_plugin.engine_api import CacheLayer, CacheState
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import IdentityCodec
from mlxcel_plugin.kv_serde import KVWriter, ModelFingerprint
from mlxcel_plugin.testing.caches import make_header


def filled_kv_cache(dtype: mx.Dtype, tokens: int = 300) -> KVCache:
    cache = KVCache()
    k = mx.random.normal((1, 2, tokens, 16), key=mx.random.key(0)).astype(dtype)
    v = mx.random.normal((1, 2, tokens, 16), key=mx.random.key(1)).astype(dtype)
    cache.update_and_fetch(k, v)
    mx.eval(cache.state)
    return cache


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kv_cache_roundtrip_is_exact_and_sliced(dtype):
    cache = filled_kv_cache(dtype)
    layer = kv_convert.to_cache_layer(cache)
    assert layer.keys.shape == (1, 2, 300, 16)  # the 512-slot buffer is sliced to the offset
    assert layer.dtype == kv_convert.dtype_name(dtype)
    if dtype == mx.bfloat16:
        assert layer.keys.dtype == np.uint16
    rebuilt = kv_convert.from_cache_layer(layer)
    assert rebuilt.offset == 300 and rebuilt.keys.dtype == dtype
    assert mx.array_equal(rebuilt.keys, cache.keys[..., :300, :]).item()
    assert mx.array_equal(rebuilt.values, cache.values[..., :300, :]).item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_exported_layers_view_the_cache_memory_and_send_the_same_bytes(dtype):
    """No numpy copy of a layer on the prefill node: the CacheLayer's arrays are the cache
    buffer's own memory, and the writer sends that strided view head by head as the same
    chunks' bytes, and the same checksums, as a contiguous copy gives."""
    cache = filled_kv_cache(dtype, tokens=300)
    layer = kv_convert.to_cache_layer(cache)
    view_as = mx.uint16 if dtype == mx.bfloat16 else dtype
    buffer = np.array(cache.keys.view(view_as), copy=False)
    assert not layer.keys.flags.c_contiguous and np.shares_memory(layer.keys, buffer)
    assert not layer.keys.flags.writeable  # MLX's memory: the node never writes it
    copied = dataclasses.replace(layer, keys=np.ascontiguousarray(layer.keys),
                                 values=np.ascontiguousarray(layer.values))
    fp = ModelFingerprint("llama", 1, 2, 16, kv_convert.dtype_name(dtype), ("KVCache",))
    header = make_header(fp, 300)

    def sent(exported):
        writer = KVWriter(header, IdentityCodec(), chunk_bytes=4096)
        chunks = writer.layer(0, exported)
        by_row = {(m.header["tensor"], m.header["row"]): bytes(m.body) for m in chunks}
        return b"".join(by_row[key] for key in sorted(by_row)), writer.end().header["checksums"]

    assert sent(layer) == sent(copied)


@pytest.mark.parametrize("cache", [type("MysteryCache", (), {})()], ids=type)
def test_unsupported_cache_classes_are_refused(cache):
    with pytest.raises(HandoffError, match=type(cache).__name__):
        kv_convert.to_cache_layer(cache)


def test_unknown_kind_cannot_be_rebuilt():
    layer = kv_convert.to_cache_layer(filled_kv_cache(mx.float32, 4))
    layer.kind = "MysteryCache"
    with pytest.raises(HandoffError, match="MysteryCache"):
        kv_convert.from_cache_layer(layer)


def test_check_cache_state_refuses_mismatches():
    layer = kv_convert.to_cache_layer(filled_kv_cache(mx.float32, 8))
    fingerprint = {"architecture": "llama", "num_layers": 1, "cache_classes": ["KVCache"],
                   "dtype": "float32", "kv_heads": 2, "head_dim": 16}
    kv_convert.check_cache_state(CacheState([layer]), fingerprint, prompt_len=8)
    with pytest.raises(HandoffError, match="layers"):
        kv_convert.check_cache_state(CacheState([layer, layer]), fingerprint, prompt_len=8)
    with pytest.raises(HandoffError, match="prompt"):
        kv_convert.check_cache_state(CacheState([layer]), fingerprint, prompt_len=9)
    with pytest.raises(HandoffError, match="dtype"):
        kv_convert.check_cache_state(CacheState([layer]), {**fingerprint, "dtype": "bfloat16"}, 8)
    with pytest.raises(HandoffError, match="shape"):
        kv_convert.check_cache_state(CacheState([layer]), {**fingerprint, "head_dim": 8}, 8)
    rotating = CacheLayer("RotatingKVCache", layer.keys, layer.values, "float32", 8)
    with pytest.raises(HandoffError, match="kind"):
        kv_convert.check_cache_state(CacheState([rotating]), fingerprint, prompt_len=8)


def _greedy(model, caches: list, first: int, steps: int) -> list[int]:
    batch = DecodeBatch(model)
    batch.add([Sequence(None, None, None, last_token=first, num_generated=1)], [caches])
    tokens = []
    for _ in range(steps):
        token = int(np.argmax(batch.step()[0]))
        batch.sequences[0].last_token = token
        tokens.append(token)
    return tokens


def test_rotating_cache_handoff_decodes_like_the_original(tiny_model_path):
    model, _ = load_mlx_model(tiny_model_path)
    prompt = list(range(100, 400))  # longer than the window: the buffer has rotated
    caches = [RotatingKVCache(max_size=128, keep=4) for _ in model.layers]
    logits = run_prefill(model, prompt, caches, 96)
    first = int(np.argmax(np.array(logits)))
    layers = [kv_convert.to_cache_layer(c) for c in caches]
    assert layers[0].kind == "RotatingKVCache" and layers[0].meta["max_size"] == 128
    rebuilt = kv_convert.from_cache_state(CacheState(layers))
    assert _greedy(model, rebuilt, first, 24) == _greedy(model, caches, first, 24)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_an_adopted_layer_holds_mlx_arrays_and_rebuilds_the_same_cache(dtype):
    cache = filled_kv_cache(dtype)
    layer = kv_convert.to_cache_layer(cache)
    # As a receive buffer: numpy memory of its own (exported layers view MLX's, read-only).
    layer = dataclasses.replace(layer, keys=np.array(layer.keys), values=np.array(layer.values))
    adopted = kv_convert.adopt_layer(layer)
    assert isinstance(adopted.keys, mx.array) and isinstance(adopted.values, mx.array)
    layer.keys[...] = 0  # the receive buffer is reused at once: the adopted layer owns a copy
    kv_convert.check_cache_state(CacheState([adopted]), _fingerprint(dtype), prompt_len=300)
    rebuilt = kv_convert.from_cache_layer(adopted)
    assert rebuilt.keys.dtype == dtype and rebuilt.offset == 300
    assert mx.array_equal(rebuilt.keys, cache.keys[..., :300, :]).item()
    assert mx.array_equal(rebuilt.values, cache.values[..., :300, :]).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_layer_received_into_kv_buffers_is_adopted_without_a_copy(dtype):
    cache = filled_kv_cache(dtype)
    sent = kv_convert.to_cache_layer(cache)
    carver = SlabCarver(mx.new_stream(mx.cpu))
    keys, values = kv_convert.kv_buffers(sent.keys.shape, sent.keys.dtype, 2, carver)
    keys[...], values[...] = sent.keys, sent.values  # what the link's decrypt does
    adopted = kv_convert.adopt_layer(dataclasses.replace(sent, keys=keys, values=values))
    for array, buffer in ((adopted.keys, keys), (adopted.values, values)):
        assert isinstance(array, mx.array) and array.shape == buffer.shape
        assert np.array(array, copy=False).ctypes.data == buffer.ctypes.data  # no copy
    rebuilt = kv_convert.from_cache_layer(adopted)
    assert rebuilt.keys.dtype == dtype
    assert mx.array_equal(rebuilt.keys, cache.keys[..., :300, :]).item()
    assert mx.array_equal(rebuilt.values, cache.values[..., :300, :]).item()
    values[0, 0, 0, 0] = 0  # the same memory: MLX sees a write into the buffer
    assert np.array(adopted.values)[0, 0, 0, 0] == 0


def test_a_view_of_part_of_a_kv_buffer_is_copied_not_taken_whole():
    carver = SlabCarver(mx.new_stream(mx.cpu))
    (whole,) = kv_convert.kv_buffers((1, 2, 8, 4), np.dtype(np.float32), 1, carver)
    whole[...] = np.arange(whole.size, dtype=np.float32).reshape(whole.shape)
    part = whole[:, :, :3]
    layer = CacheLayer("KVCache", part, part, "float32", 3)
    adopted = kv_convert.adopt_layer(layer)
    assert adopted.keys.shape == (1, 2, 3, 4)
    assert np.array_equal(np.array(adopted.keys), part)


def test_kv_buffers_refuses_a_dtype_mlx_cannot_hold_as_kv():
    carver = SlabCarver(mx.new_stream(mx.cpu))
    with pytest.raises(HandoffError, match="storage dtype"):
        kv_convert.kv_buffers((1, 1, 1, 4), np.dtype(np.int64), 1, carver)


def _fingerprint(dtype: mx.Dtype) -> dict:
    return {"architecture": "llama", "num_layers": 1, "cache_classes": ["KVCache"],
            "dtype": kv_convert.dtype_name(dtype), "kv_heads": 2, "head_dim": 16}
