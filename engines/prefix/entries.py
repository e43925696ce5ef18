"""What a prefix-cache entry holds of a sequence's caches: a snapshot, views, the same
arrays, or a compact copy (``engines/prefix/cache.py`` says which when)."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

__all__ = ["compact_copy", "reading", "sharing", "snapshot"]


def snapshot(caches: list[Any]) -> list[Any]:
    """An independent copy of any caches' state, as mlx-lm's prompt cache takes one.

    ``deepcopy`` gives new array objects over the same memory: the model
    replaces SSM state arrays, and writing into a KV buffer a snapshot
    shares makes MLX copy that buffer first, so the snapshot never changes.
    """
    return copy.deepcopy(caches)


def reading(caches: list[Any], n_tokens: int) -> list[KVCache]:
    """Fresh caches over the first ``n_tokens`` of ``caches``, sharing their memory.

    The views are new array objects: extending one (``update_and_fetch``)
    allocates a new buffer and copies the prefix into it, so the stored
    entry is never written.
    """
    views = []
    for cache in caches:
        view = KVCache()
        view.state = (cache.keys[..., :n_tokens, :], cache.values[..., :n_tokens, :], n_tokens)
        views.append(view)
    return views


def sharing(caches: list[Any], n_tokens: int) -> list[KVCache]:
    """Fresh caches holding the first ``n_tokens`` of ``caches`` through the very same array
    objects (not slices of them).

    Why the same objects: MLX writes into an array in place only while no other array
    shares its memory. A received cache with room goes on decoding into its buffer
    (engines/kv_room.py), past ``n_tokens``, where this entry never reads; a slice would
    make that first write copy the whole buffer. A full cache grows into a new buffer
    at its next step and the entry keeps the old one, as with a slice.
    """
    shared = []
    for cache in caches:
        view = KVCache()
        view.state = (cache.keys, cache.values, n_tokens)
        shared.append(view)
    return shared


def compact_copy(caches: list[Any], n_tokens: int) -> list[KVCache]:
    """New caches holding exactly the first ``n_tokens`` (own, contiguous memory)."""
    copies = []
    for cache in caches:
        keys = mx.contiguous(cache.keys[..., :n_tokens, :])
        values = mx.contiguous(cache.values[..., :n_tokens, :])
        copy = KVCache()
        copy.state = (keys, values, n_tokens)
        copies.append(copy)
    mx.eval([(c.keys, c.values) for c in copies])
    return copies
