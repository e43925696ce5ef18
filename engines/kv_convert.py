"""mlx-lm per-sequence caches <-> ``CacheLayer`` (numpy, sliced to the live tokens).

Only ``KVCache`` and ``RotatingKVCache`` can travel; any other cache class
(``ArraysCache``, ``QuantizedKVCache``, ...) is refused with ``HandoffError``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engines.unfilled import SlabCarver, mlx_view
from mlxcel_plugin.engine_api import CacheLayer, CacheState
from mlxcel_plugin.errors import HandoffError

SUPPORTED_KINDS = ("KVCache", "RotatingKVCache")

# numpy has no bfloat16: it travels as the raw uint16 bit pattern.
_VIEW_AS = {mx.bfloat16: mx.uint16}
_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# numpy storage dtype of received K/V -> MLX dtype of the same bytes.
_MX_STORAGE = {np.dtype(np.float32): mx.float32, np.dtype(np.float16): mx.float16,
               np.dtype(np.uint16): mx.uint16}


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def check_cache_kinds(caches: list[Any]) -> None:
    """Raise ``HandoffError`` unless every layer's cache can be exported."""
    for i, cache in enumerate(caches):
        kind = type(cache).__name__
        if kind not in SUPPORTED_KINDS:
            raise HandoffError(
                f"layer {i}: cache class {kind} cannot be handed off "
                f"(supported: {', '.join(SUPPORTED_KINDS)})"
            )


def _to_numpy(x: mx.array) -> np.ndarray:
    view = _VIEW_AS.get(x.dtype)
    return np.array(x.view(view) if view is not None else x)


def live_keys_values(cache: Any) -> tuple[mx.array, mx.array]:
    """The cached K/V without the unused tail of the buffer (temporal order for rotating)."""
    if isinstance(cache, RotatingKVCache):
        return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


def to_cache_layer(cache: Any) -> CacheLayer:
    """Copy one evaluated per-sequence cache to numpy."""
    check_cache_kinds([cache])
    keys, values = live_keys_values(cache)
    meta: dict[str, Any] = {}
    if isinstance(cache, RotatingKVCache):
        meta = {"max_size": cache.max_size, "keep": cache.keep, "idx": keys.shape[2]}
    return CacheLayer(
        kind=type(cache).__name__,
        keys=_to_numpy(keys),
        values=_to_numpy(values),
        dtype=dtype_name(keys.dtype),
        offset=int(cache.offset),
        meta=meta,
    )


def keep_freed_buffers(kv_memory_bytes: int) -> int:
    """Let MLX keep up to the KV budget of freed buffers for reuse; returns the limit in force.

    Why: MLX's CPU allocator caches only 32 MiB of freed buffers by default, so
    every handed-off cache (``adopt_layer``) lands in memory fresh from the OS
    and page-faults as it is copied: 256 MiB took ~95 ms to copy into MLX, ~15 ms
    into reused buffers (bench_kv_handoff, 2 cores). Only ever raises the limit.
    """
    previous = mx.set_cache_limit(kv_memory_bytes)
    if previous > kv_memory_bytes:
        mx.set_cache_limit(previous)
    return max(previous, kv_memory_bytes)


def kv_buffers(
    shape: tuple[int, ...], dtype: np.dtype, count: int, carver: SlabCarver
) -> list[np.ndarray]:
    """Fresh MLX arrays' memory as writable numpy views (what ``adopt_layer`` takes back).

    Why: received K/V decrypted straight into MLX memory skips the copy into
    MLX per layer (256 MiB: ~30 ms copying), and the arrays are neither
    filled first nor allocated one by one (``unfilled``). The carver's stream
    must not be the engine's: an allocation there would wait for the running
    decode step.
    """
    storage = _MX_STORAGE.get(np.dtype(dtype))
    if storage is None:
        raise HandoffError(f"unsupported KV storage dtype {np.dtype(dtype)}")
    return carver.buffers(shape, np.dtype(dtype), storage, count)


def adopt_layer(layer: CacheLayer, stream: mx.Stream | None = None) -> CacheLayer:
    """The layer with its K/V as MLX arrays (storage dtype: bf16 stays uint16).

    Tensors received into ``kv_buffers`` memory become views of that MLX
    memory; others are copied. Safe off the engine thread: neither the lazy
    view nor ``mx.array`` of a numpy buffer (it copies at construction)
    schedules MLX work; the bf16 view waits for ``from_cache_layer`` on the
    engine thread. ``stream``: the evaluating thread's (``unfilled.mlx_view``).
    """
    if layer.dtype not in _MX_DTYPES:
        raise HandoffError(f"unsupported KV dtype {layer.dtype!r}")
    keys, values = _as_mlx(layer.keys, stream), _as_mlx(layer.values, stream)
    return dataclasses.replace(layer, keys=keys, values=values)


def _as_mlx(x: np.ndarray | mx.array, stream: mx.Stream | None = None) -> mx.array:
    """The MLX array a ``kv_buffers`` view shows, else a copy of ``x`` into MLX."""
    if isinstance(x, mx.array):
        return x
    view = mlx_view(x, stream)
    return mx.array(x) if view is None else view


def _to_mlx(x: np.ndarray | mx.array, dtype: str) -> mx.array:
    if dtype not in _MX_DTYPES:
        raise HandoffError(f"unsupported KV dtype {dtype!r}")
    arr = _as_mlx(x)  # adopted layers are MLX already
    target = _MX_DTYPES[dtype]
    return arr.view(target) if target in _VIEW_AS else arr.astype(target)


def from_cache_layer(layer: CacheLayer) -> KVCache | RotatingKVCache:
    """Rebuild the mlx-lm cache a ``CacheLayer`` was exported from."""
    keys, values = _to_mlx(layer.keys, layer.dtype), _to_mlx(layer.values, layer.dtype)
    if layer.kind == "KVCache":
        cache = KVCache()
    elif layer.kind == "RotatingKVCache":
        cache = RotatingKVCache(max_size=int(layer.meta["max_size"]), keep=int(layer.meta["keep"]))
        cache._idx = int(layer.meta.get("idx", keys.shape[2]))
    else:
        raise HandoffError(
            f"cache kind {layer.kind!r} cannot be decoded (supported: {', '.join(SUPPORTED_KINDS)})"
        )
    cache.keys, cache.values, cache.offset = keys, values, int(layer.offset)
    return cache


def to_cache_state(caches: list[Any]) -> CacheState:
    return CacheState(layers=[to_cache_layer(c) for c in caches])


def from_cache_state(state: CacheState) -> list[KVCache | RotatingKVCache]:
    return [from_cache_layer(layer) for layer in state.layers]


def check_cache_state(
    state: CacheState, fingerprint: dict[str, Any], prompt_len: int, prefix_tokens: int = 0
) -> None:
    """Refuse a handed-off cache that this model cannot decode from (before allocating).

    ``prefix_tokens``: a delta handoff's, whose layers hold only the positions after it.
    """
    kinds = fingerprint["cache_classes"]
    if len(state.layers) != len(kinds):
        raise HandoffError(f"cache has {len(state.layers)} layers, model has {len(kinds)}")
    for i, (layer, kind) in enumerate(zip(state.layers, kinds, strict=True)):
        if layer.kind != kind:
            raise HandoffError(f"layer {i}: cache kind {layer.kind!r}, model uses {kind!r}")
        if layer.dtype != fingerprint["dtype"]:
            want = fingerprint["dtype"]
            raise HandoffError(f"layer {i}: KV dtype {layer.dtype}, model uses {want}")
        _check_layer_shape(i, layer, fingerprint, prompt_len, prefix_tokens)


def _check_layer_shape(
    i: int, layer: CacheLayer, fingerprint: dict[str, Any], prompt_len: int, prefix_tokens: int
) -> None:
    want = (1, fingerprint["kv_heads"], fingerprint["head_dim"])
    for name, arr in (("keys", layer.keys), ("values", layer.values)):
        if arr.ndim != 4 or (arr.shape[0], arr.shape[1], arr.shape[3]) != want:
            raise HandoffError(f"layer {i}: {name} shape {arr.shape} does not fit {want}")
    if layer.offset != prompt_len:
        raise HandoffError(f"layer {i}: cache holds {layer.offset} tokens, prompt has {prompt_len}")
    if prefix_tokens and layer.kind != "KVCache":
        raise HandoffError(f"layer {i}: a {layer.kind} cannot take a delta handoff")
    if layer.kind == "KVCache" and layer.keys.shape[2] != layer.offset - prefix_tokens:
        stored, after = layer.keys.shape[2], f" after a prefix of {prefix_tokens}"
        raise HandoffError(f"layer {i}: {stored} cached positions for offset {layer.offset}"
                           f"{after if prefix_tokens else ''}")
