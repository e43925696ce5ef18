"""Synthetic KV caches, fingerprints and headers for tests, contracts and benchmarks.

``smooth=True`` gives per-channel sinusoids over tokens (RoPE-like, slowly
varying: shuffle+lz4 finds ≈1.1–1.5×); the default is Gaussian noise scaled
per channel, which no lossless codec shrinks — the pessimistic case.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mlxcel_plugin.engine_api import CacheLayer, CacheState, SamplingParams
from mlxcel_plugin.kv_codecs import from_float32
from mlxcel_plugin.kv_serde import HandoffHeader, ModelFingerprint, SerializableSamplingState
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec, LayerSpec


def make_fingerprint(
    num_layers: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    dtype: str = "float16",
    kinds: Sequence[str] | None = None,
    architecture: str = "llama",
) -> ModelFingerprint:
    return ModelFingerprint(
        architecture=architecture,
        num_layers=num_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        cache_classes=tuple(kinds or ["KVCache"] * num_layers),
    )


def mixed_fingerprint(dtype: str = "float16") -> ModelFingerprint:
    """One layer of each described kind: MLA K/V, SSM state, quantized K/V, plain K/V."""
    def grow(name: str, heads: int, width: int, kind_dtype: str = dtype, coded: bool = True):
        return ArraySpec(name, (1, heads, 0, width), kind_dtype, 2, coded)

    parts = (("", 8, "uint32"), (".scales", 2, dtype), (".biases", 2, dtype))
    quant = tuple(grow(f"{t}{part}", 2, w, d, False) for t in "kv" for part, w, d in parts)
    layers = (
        LayerSpec("KVCache", (grow("k", 1, 24), grow("v", 1, 8))),
        LayerSpec("ArraysCache", (ArraySpec("s0", (1, 3, 40), dtype),
                                  ArraySpec("s1", (1, 4, 8, 6), "float32"))),
        LayerSpec("QuantizedKVCache", quant),
        LayerSpec("KVCache", (grow("k", 2, 16), grow("v", 2, 16))),
    )
    return ModelFingerprint("hybrid", len(layers), 0, 0, dtype,
                            tuple(layer.kind for layer in layers), layers=layers)


def make_described_cache(fingerprint: ModelFingerprint, tokens: int, seed: int = 0) -> CacheState:
    """Random arrays of every layer as its spec describes them (fixed-size state included)."""
    rng = np.random.default_rng(seed)
    layers = []
    for spec in fingerprint.layers:
        arrays = {}
        for array in spec.arrays:
            shape = array.shape_for(tokens)
            if array.dtype == "uint32":
                arrays[array.name] = rng.integers(0, 2**32, size=shape, dtype=np.uint32)
            else:
                arrays[array.name] = make_tensor(rng, shape, array.dtype)
        layers.append(CacheLayer.of_arrays(spec.kind, arrays, fingerprint.dtype, tokens))
    return CacheState(layers)


def make_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: str, smooth: bool = False
) -> np.ndarray:
    """A float tensor in its wire storage dtype (bfloat16 as uint16 bits)."""
    channel_scale = rng.uniform(0.1, 4.0, size=shape[-1]).astype(np.float32)
    if smooth:
        tokens = np.arange(shape[2], dtype=np.float32).reshape(1, 1, -1, 1)
        # A phase per head and channel: heads must not repeat each other's bytes.
        phase = rng.uniform(0.0, 6.0, size=(1, shape[1], 1, shape[-1])).astype(np.float32)
        values = np.sin(tokens / 40.0 + phase) * channel_scale
    else:
        values = rng.standard_normal(shape).astype(np.float32) * channel_scale
    return from_float32(values, dtype)


def make_cache(
    fingerprint: ModelFingerprint,
    tokens: int,
    seed: int = 0,
    smooth: bool = False,
    rotating_max_size: int = 128,
) -> CacheState:
    """A cache after prefilling ``tokens`` tokens; RotatingKVCache layers keep a window."""
    rng = np.random.default_rng(seed)
    layers = []
    for kind in fingerprint.cache_classes:
        held, meta = tokens, {}
        if kind == "RotatingKVCache":
            held = min(tokens, rotating_max_size)
            meta = {"keep": 0, "max_size": rotating_max_size, "step": 256, "idx": held}
        shape = (1, fingerprint.kv_heads, held, fingerprint.head_dim)
        keys = make_tensor(rng, shape, fingerprint.dtype, smooth)
        values = make_tensor(rng, shape, fingerprint.dtype, smooth)
        layers.append(CacheLayer(kind, keys, values, fingerprint.dtype, tokens, meta))
    return CacheState(layers)


def make_header(
    fingerprint: ModelFingerprint,
    prompt_length: int,
    *,
    codec: str = "none",
    request_id: str = "req-1",
    handoff_id: str = "h-1",
    epoch: int = 0,
) -> HandoffHeader:
    sampling = SerializableSamplingState(
        params=SamplingParams(temperature=0.7, top_p=0.9, seed=1234, repetition_penalty=1.1),
        prompt_tokens=tuple(range(prompt_length)),
        step=1,
        stop_token_ids=(2,),
        max_tokens=64,
    )
    return HandoffHeader(
        request_id=request_id,
        handoff_id=handoff_id,
        epoch=epoch,
        fingerprint=fingerprint,
        prompt_length=prompt_length,
        first_token=42,
        codec=codec,
        sampling=sampling,
        deadline_in_s=30.0,
    )


def assert_caches_equal(actual: CacheState, expected: CacheState) -> None:
    """Bit-exact equality, kind, offset and meta included (raises AssertionError)."""
    if len(actual.layers) != len(expected.layers):
        raise AssertionError(f"{len(actual.layers)} layers != {len(expected.layers)}")
    for index, (got, want) in enumerate(zip(actual.layers, expected.layers, strict=True)):
        same = (got.kind, got.dtype, got.offset, got.meta) == (
            want.kind,
            want.dtype,
            want.offset,
            want.meta,
        )
        if not same:
            raise AssertionError(f"layer {index}: kind/dtype/offset/meta differ")
        if got.arrays().keys() != want.arrays().keys():
            raise AssertionError(f"layer {index}: arrays {list(got.arrays())} differ")
        for name, b in want.arrays().items():
            a = got.array(name)
            if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b):
                raise AssertionError(f"layer {index} {name} differ")
