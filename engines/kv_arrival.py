"""A handed-off cache converted into this engine's form before it decodes (kv_serde/convert.py).

The receiver assembled a converting handoff in the sender's form: K/V in
another float dtype (cast here to the model's, in MLX, one pass over the
received arrays), or plain K/V that this ``kv_bits`` engine keeps quantized
(checked against its plain layers here, quantized by ``KVQuantizer`` once the
caches are rebuilt, as after a local prefill).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from engines.prefix.cache import Pin
from engines.prefix.splice import check_handoff
from mlxcel_plugin.engine_api import CacheLayer, CacheState
from mlxcel_plugin.kv_serde.convert import QUANTIZED_KIND, UNQUANTIZED

_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _model_array(x: Any, dtype: str) -> mx.array:
    """A received array as MLX in its own dtype (bfloat16 arrives as its uint16 bits)."""
    array = x if isinstance(x, mx.array) else mx.array(np.asarray(x))
    return array.view(mx.bfloat16) if dtype == "bfloat16" and array.dtype == mx.uint16 else array


def cast_layer(layer: CacheLayer, target: str) -> CacheLayer:
    """The layer's arrays of its own dtype cast to ``target`` (lazy: evaluated as it decodes)."""
    if layer.dtype == target or layer.kind == QUANTIZED_KIND or layer.dtype not in _MX_DTYPES:
        return layer
    source = _MX_DTYPES[layer.dtype]
    arrays = {}
    for name, x in layer.arrays().items():
        array = _model_array(x, layer.dtype)
        arrays[name] = array.astype(_MX_DTYPES[target]) if array.dtype == source else array
    return CacheLayer.of_arrays(layer.kind, arrays, target, layer.offset, layer.meta)


def arrive(state: CacheState, fingerprint: dict[str, Any]) -> tuple[CacheState, dict[str, Any]]:
    """``state`` in the model's dtype, and the fingerprint to check it against.

    A kv_bits engine given plain K/V (the sender does not quantize) checks them
    against its unquantized layers; ``quantizes`` then says to quantize them.
    """
    target = fingerprint["dtype"]
    cast = CacheState([cast_layer(layer, target) for layer in state.layers])
    plain = fingerprint.get(UNQUANTIZED)
    if plain is not None and quantizes(cast, fingerprint):
        return cast, {**fingerprint, **plain}
    return cast, fingerprint


def checked(state: CacheState, fingerprint: dict[str, Any], prompt_len: int,
            pin: Pin | None) -> CacheState:
    """``state`` converted (``arrive``) and checked as any handoff is; raises HandoffError."""
    cache, checked_against = arrive(state, fingerprint)
    check_handoff(cache, checked_against, prompt_len, pin)
    return cache


def quantizes(state: CacheState, fingerprint: dict[str, Any]) -> bool:
    """Whether plain K/V arrived for layers this engine keeps quantized."""
    kinds = fingerprint.get("cache_classes", ())
    return any(kind == QUANTIZED_KIND and layer.kind != QUANTIZED_KIND
               for kind, layer in zip(kinds, state.layers, strict=False))
