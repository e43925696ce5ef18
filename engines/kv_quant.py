"""``[engine] kv_bits``: K/V kept as mlx-lm ``QuantizedKVCache`` once a prompt is prefilled.

Like ``mlx_lm.generate``'s ``kv_bits`` (``maybe_quantize_kv_cache``: each
``KVCache`` becomes ``c.to_quantized(group_size, bits)``), with the switch
point fixed at the end of the prompt: the prompt is prefilled at full
precision, its K/V are quantized as the prefill ends, and every decode step
attends over (and appends to) the quantized cache. mlx-lm's
``quantized_kv_start`` would switch mid-decode, inside a running batch; one
fixed point keeps hybrid, prefill and decode nodes computing the same bits.

Only plain ``KVCache`` layers are quantized (mlx-lm cannot quantize rotating
windows or SSM state either); a ``CacheList``'s ``KVCache`` members are. A
prefill node ships the packed words, scales and biases as they are
(docs/architectures.md), and the fingerprint describes the quantized layers,
so a decode node must run with the same ``kv_bits`` and ``kv_group_size``, or take
a plain sender's K/V and quantize them on arrival (``engines/kv_arrival.py``).

Batched decode: mlx-lm's ``QuantizedKVCache`` has no batch form (no
``merge``), so a quantized sequence decodes in a group of its own
(``decode_batch``): its own forward each step, all groups evaluated together
and sharing one vocabulary projection. The prefix cache keeps full-precision
prompt chunks only (it stores before quantizing), so delta handoffs never
carry quantized layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, make_prompt_cache

from engines import cache_layout
from mlxcel_plugin.engine_api import EngineConfig, ModelInfo
from mlxcel_plugin.errors import ConfigError, HandoffError
from mlxcel_plugin.kv_serde.convert import UNQUANTIZED
from mlxcel_plugin.kv_serde.layer_spec import LayerSpec

KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
PLAIN_KEYS = ("kv_heads", "head_dim", "cache_classes", "layers")


class KVQuantizer:
    """Turns a prefilled sequence's ``KVCache`` layers into ``QuantizedKVCache`` (kv_bits)."""

    def __init__(self, config: EngineConfig):
        self.bits, self.group_size = config.kv_bits, config.kv_group_size
        if self.bits and self.bits not in KV_BITS:
            raise ConfigError(f"[engine] kv_bits must be 0 (off) or one of {KV_BITS}, "
                              f"got {self.bits}")
        if self.bits and self.group_size not in KV_GROUP_SIZES:
            raise ConfigError(f"[engine] kv_group_size must be one of {KV_GROUP_SIZES}, "
                              f"got {self.group_size}")

    @property
    def enabled(self) -> bool:
        return bool(self.bits)

    def cache(self, cache: Any) -> Any:
        """One model cache, quantized where it is a ``KVCache`` (a ``CacheList``'s members)."""
        if not self.enabled:
            return cache
        if isinstance(cache, CacheList):
            return CacheList(*(self.cache(c) for c in cache.caches))
        if type(cache) is not KVCache:
            return cache
        try:
            quantized = cache.to_quantized(group_size=self.group_size, bits=self.bits)
        except ValueError as exc:  # head_dim not a multiple of the group size
            raise ConfigError(f"kv_bits={self.bits}, kv_group_size={self.group_size}: {exc}") \
                from exc
        mx.eval([quantized.keys, quantized.values])
        return quantized

    def caches(self, caches: list[Any]) -> list[Any]:
        return [self.cache(c) for c in caches] if self.enabled else caches

    def described(self, info: ModelInfo, model: nn.Module) -> ModelInfo:
        """``info`` with its fingerprint's layers as they travel: quantized (at startup)."""
        if not self.enabled:
            return info
        caches = make_prompt_cache(model)
        mx.eval(model(mx.array([cache_layout.PROBE_TOKENS], dtype=mx.uint32), cache=caches))
        specs = [_describe(leaf) for leaf in cache_layout.leaves(self.caches(caches))]
        uniform = all(spec.names == ("k", "v") for spec in specs)
        # The plain layers too: a plain sender's K/V are quantized here on arrival (convert.py).
        plain = {key: info.fingerprint.get(key) for key in PLAIN_KEYS}
        fingerprint = {**info.fingerprint, "cache_classes": [spec.kind for spec in specs],
                       "layers": [spec.to_dict() for spec in specs], UNQUANTIZED: plain}
        if not uniform:  # kv_heads/head_dim describe plain K/V only (older peers read them)
            fingerprint |= {"kv_heads": 0, "head_dim": 0}
        return dataclasses.replace(info, fingerprint=fingerprint)


def _describe(leaf: Any) -> LayerSpec:
    try:
        return cache_layout.describe_leaf(leaf)
    except HandoffError:
        return LayerSpec(type(leaf).__name__, ())


def mergeable(caches: list[Any]) -> bool:
    """Whether a sequence's caches can join a batch (``QuantizedKVCache`` has no ``merge``)."""
    return not any(isinstance(c, QuantizedKVCache) for c in cache_layout.leaves(caches))
