"""A ``KVCache`` as one prefill forward sees it: keys padded (zeros, masked) to the cell's end.

OpenBLAS blocks the reduction of ``scores @ V`` by the number of keys, so a
query attending to the first 1,300 keys rounds differently from the same
query attending to the first 1,408 with the last 108 masked out. Padding
every forward's keys to the end of its grid cell (``engines/prefix/grid.py``)
gives every forward in a cell the same key count, whatever rows it computes;
masked positions weigh exactly 0, so the padding adds exact zeros.

The wrapper writes into the wrapped cache's own buffer (a plain ``KVCache``
afterwards, holding exactly the tokens written) and hands the model a causal
mask over the padded width; decode steps use the plain caches.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class PaddedKeys:
    """``cache`` for one forward whose keys are padded to ``padded_len`` positions."""

    def __init__(self, cache: KVCache, padded_len: int):
        self._cache = cache
        self._padded_len = padded_len

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    @property
    def offset(self) -> int:
        return self._cache.offset

    def make_mask(self, n: int, **_kwargs: Any) -> mx.array:
        """Query ``offset + i`` sees keys up to itself; the padding is never seen."""
        queries = mx.arange(self._cache.offset, self._cache.offset + n)
        return queries[:, None] >= mx.arange(self._padded_len)[None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        cache, start = self._cache, self._cache.offset
        end = start + keys.shape[2]
        if end > self._padded_len:
            raise ValueError(f"a forward ending at {end} crosses its cell ({self._padded_len})")
        _reserve(cache, keys, values, self._padded_len)
        cache.keys[..., start:end, :] = keys
        cache.values[..., start:end, :] = values
        cache.offset = end
        return cache.keys[..., : self._padded_len, :], cache.values[..., : self._padded_len, :]


def _reserve(cache: KVCache, keys: mx.array, values: mx.array, length: int) -> None:
    """Make ``cache``'s buffers at least ``length`` long; new positions are zeros."""
    if cache.keys is not None and cache.keys.shape[2] >= length:
        return
    size = -(-length // cache.step) * cache.step
    batch, heads, _, key_dim = keys.shape
    new_keys = mx.zeros((batch, heads, size, key_dim), keys.dtype)
    new_values = mx.zeros((batch, heads, size, values.shape[3]), values.dtype)
    if cache.keys is not None and cache.offset > 0:
        held = cache.offset
        new_keys[..., :held, :] = cache.keys[..., :held, :]
        new_values[..., :held, :] = cache.values[..., :held, :]
    cache.keys, cache.values = new_keys, new_values


def padded(caches: list[Any], padded_len: int) -> list[PaddedKeys]:
    return [PaddedKeys(cache, padded_len) for cache in caches]
