"""A model's caches described from the cache objects, and leaf caches <-> handoff arrays.

A handoff layer is one *leaf* cache: ``make_prompt_cache(model)`` flattened,
a ``CacheList`` (attention + SSM in one layer) contributing each of its
caches. Each leaf kind maps to named arrays (docs/architectures.md):

* ``KVCache``/``RotatingKVCache``/``ChunkedKVCache``: ``k``, ``v`` ``[1, heads, T, dim]``; MLA
  models give K and V different widths (or one latent head): the shapes say so.
* ``QuantizedKVCache`` (``kv_bits``): ``k``/``v`` packed uint32 words plus
  ``k.scales``, ``k.biases``, ``v.scales``, ``v.biases``, shipped as they are.
* ``ArraysCache`` (SSM conv and recurrent state): ``s0``, ``s1``, ... of a
  fixed size (no growing axis), shipped whole once the layer's prefill is done.

The description is read from the arrays after a probe prefill, so no config
key (heads, head_dim) is assumed for any architecture.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlxcel_plugin.errors import CacheNotTransferableError, HandoffError
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec, LayerSpec

HANDOFF_KINDS = ("KVCache", "RotatingKVCache", "ChunkedKVCache", "QuantizedKVCache",
                 "ArraysCache")
PROBE_TOKENS = (0, 1)
_QUANT_PARTS = ("", ".scales", ".biases")


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def leaves(caches: list[Any]) -> list[Any]:
    """The handoff layers: every cache, a ``CacheList``'s caches in its place."""
    out: list[Any] = []
    for cache in caches:
        out.extend(cache.caches if isinstance(cache, CacheList) else [cache])
    return out


def nesting(caches: list[Any]) -> list[int]:
    """Per model cache: 0 for a leaf, else how many leaves its ``CacheList`` holds."""
    return [len(c.caches) if isinstance(c, CacheList) else 0 for c in caches]


def nest(flat: list[Any], shape: list[int]) -> list[Any]:
    """The model's cache list from its leaves (the inverse of ``leaves``)."""
    out, at = [], 0
    for size in shape:
        out.append(CacheList(*flat[at : at + size]) if size else flat[at])
        at += size or 1
    if at != len(flat):
        raise HandoffError(f"{len(flat)} handoff layers for a model of {at}")
    return out


def unsupported_kinds(caches: list[Any]) -> list[str]:
    return sorted({type(c).__name__ for c in leaves(caches)} - set(HANDOFF_KINDS))


def live_arrays(cache: Any) -> dict[str, mx.array]:
    """A leaf cache's arrays by handoff name, K/V cut to the live tokens (temporal order).

    By class name, as ``unsupported_kinds`` decides: a subclass (another mlx-lm's class,
    say) may keep more state than its base, so it has no handoff form.
    """
    if type(cache).__name__ not in HANDOFF_KINDS:
        raise CacheNotTransferableError(
            f"cache class {type(cache).__name__} cannot be handed off "
            f"(supported: {', '.join(HANDOFF_KINDS)})"
        )
    if isinstance(cache, RotatingKVCache):
        return {"k": cache._temporal_order(cache.keys), "v": cache._temporal_order(cache.values)}
    if isinstance(cache, ChunkedKVCache):  # llama4's local layers: the last chunk_size tokens
        keys, values = cache.keys_and_values()
        return {"k": keys, "v": values}
    if isinstance(cache, QuantizedKVCache):
        keys, values = cache.keys_and_values()
        named = {f"k{p}": a for p, a in zip(_QUANT_PARTS, keys, strict=True)}
        return named | {f"v{p}": a for p, a in zip(_QUANT_PARTS, values, strict=True)}
    if isinstance(cache, ArraysCache):
        return {f"s{i}": a for i, a in enumerate(cache.cache) if a is not None}
    return {"k": cache.keys[..., : cache.offset, :], "v": cache.values[..., : cache.offset, :]}


def layer_meta(cache: Any, held_tokens: int) -> dict[str, Any]:
    if isinstance(cache, RotatingKVCache):
        return {"max_size": cache.max_size, "keep": cache.keep, "idx": held_tokens}
    if isinstance(cache, ChunkedKVCache):
        return {"chunk_size": cache.chunk_size, "start_position": cache.start_position}
    if isinstance(cache, QuantizedKVCache):
        return {"group_size": cache.group_size, "bits": cache.bits}
    if isinstance(cache, ArraysCache):
        return {"size": len(cache.cache)}
    return {}


def grows(cache: Any) -> bool:
    return not isinstance(cache, ArraysCache)


def describe_leaf(cache: Any) -> LayerSpec:
    """A probed leaf cache's arrays: shape (growing axis 0), dtype, growing axis, codec."""
    growing = grows(cache)
    specs = []
    for name, array in live_arrays(cache).items():
        shape = list(array.shape)
        if growing:
            shape[2] = 0
        coded = growing and mx.issubdtype(array.dtype, mx.floating) and "." not in name
        coded = coded and not isinstance(cache, QuantizedKVCache)
        specs.append(ArraySpec(name, tuple(shape), dtype_name(array.dtype),
                               2 if growing else None, coded))
    return LayerSpec(type(cache).__name__, tuple(specs))


def describe_model(model: nn.Module) -> list[LayerSpec]:
    """Every handoff layer's spec, from a probe prefill (no arrays: a kind that cannot travel)."""
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([PROBE_TOKENS], dtype=mx.uint32), cache=caches))
    described: list[LayerSpec] = []
    for cache in leaves(caches):
        try:
            described.append(describe_leaf(cache))
        except HandoffError:
            described.append(LayerSpec(type(cache).__name__, ()))
    return described


def rebuild_leaf(kind: str, arrays: dict[str, mx.array], offset: int,
                 meta: dict[str, Any]) -> Any:
    """The mlx-lm leaf cache a handoff layer was exported from (arrays already MLX)."""
    if kind == "ArraysCache":
        cache = ArraysCache(int(meta.get("size", len(arrays))))
        for i in range(len(cache.cache)):
            cache.cache[i] = arrays.get(f"s{i}")
        return cache
    if kind == "QuantizedKVCache":
        cache = QuantizedKVCache(int(meta["group_size"]), int(meta["bits"]))
        cache.keys = tuple(arrays[f"k{p}"] for p in _QUANT_PARTS)
        cache.values = tuple(arrays[f"v{p}"] for p in _QUANT_PARTS)
    elif kind == "RotatingKVCache":
        cache = RotatingKVCache(max_size=int(meta["max_size"]), keep=int(meta["keep"]))
        cache._idx = int(meta.get("idx", arrays["k"].shape[2]))
        cache.keys, cache.values = arrays["k"], arrays["v"]
    elif kind == "ChunkedKVCache":
        cache = ChunkedKVCache(int(meta["chunk_size"]))
        cache.start_position = int(meta["start_position"])
        cache.keys, cache.values = arrays["k"], arrays["v"]
    elif kind == "KVCache":
        cache = KVCache()
        cache.keys, cache.values = arrays["k"], arrays["v"]
    else:
        raise HandoffError(
            f"cache kind {kind!r} cannot be decoded (supported: {', '.join(HANDOFF_KINDS)})"
        )
    cache.offset = int(offset)
    return cache
