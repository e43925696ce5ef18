"""A delta handoff's decode cache: the pinned prefix K/V, then the received positions.

The prefill node shipped positions ``[m, T)`` of every layer; the first ``m``
came from this node's prefix cache, pinned when the handoff began
(``PrefixCache.pin``). Both are prefill bits of the same chunks, so the
spliced cache is the one a full handoff would have brought (docs/cluster-flow.md).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engines import kv_convert
from engines.prefix.cache import Pin
from mlxcel_plugin.engine_api import CacheState
from mlxcel_plugin.errors import HandoffError


def check_handoff(state: CacheState, fingerprint: dict[str, Any], prompt_len: int,
                  pin: Pin | None) -> None:
    """Refuse a handed-off cache this model cannot decode from (a delta needs its pin)."""
    prefix = pin.tokens if pin is not None else 0
    kv_convert.check_cache_state(state, fingerprint, prompt_len, prefix)
    if pin is not None and len(pin.caches) != len(state.layers):
        raise HandoffError(f"pinned prefix has {len(pin.caches)} layers")


def handoff_caches(state: CacheState, pin: Pin | None, nesting: list[int] | None = None
                   ) -> list[Any]:
    """The engine's caches for a checked handoff: the pinned prefix spliced in front.

    ``nesting``: ``cache_layout.nesting`` of the model's caches (CacheList layers).
    """
    if pin is None:
        return kv_convert.from_cache_state(state, nesting)
    caches = kv_convert.from_cache_state(state)  # a delta: plain KVCache layers only
    n = pin.tokens
    for held, cache in zip(pin.caches, caches, strict=True):
        cache.keys = mx.concatenate([held.keys[..., :n, :], cache.keys], axis=2)
        cache.values = mx.concatenate([held.values[..., :n, :], cache.values], axis=2)
    # Own arrays now: the pinned entry may be evicted and freed the next moment.
    mx.eval([(c.keys, c.values) for c in caches])
    return caches
