"""Delta handoffs: only the positions a receiver lacks, on both sides of the wire (pure).

When the decode node already holds the K/V of the first ``m`` prompt tokens
(its prefix cache), the begin header says ``prefix_tokens = m`` and every
layer carries positions ``[m, prompt_length)`` only; the receiver splices its
own prefix in front (docs/cluster-flow.md, "Delta handoff"). Only plain
``KVCache`` layers qualify: a rotating window cannot be cut at a position.
"""

from __future__ import annotations

import dataclasses

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_serde.errors import MalformedHandoff, UnsupportedCacheKind
from mlxcel_plugin.kv_serde.header import HandoffHeader, ModelFingerprint
from mlxcel_plugin.kv_serde.messages import LayerDescriptor

DELTA_CACHE_KIND = "KVCache"


def can_ship_delta(fingerprint: ModelFingerprint) -> bool:
    return all(kind == DELTA_CACHE_KIND for kind in fingerprint.cache_classes)


def delta_layer(layer: CacheLayer, header: HandoffHeader, index: int = 0) -> CacheLayer:
    """What a layer ships: positions ``[prefix_tokens, offset)`` (views: no copy), or all."""
    prefix = header.prefix_tokens
    if not prefix:
        return layer
    if layer.kind != DELTA_CACHE_KIND:
        raise UnsupportedCacheKind(f"layer {index}: a {layer.kind} cannot be sent as a delta")
    held = layer.keys.shape[2] if layer.keys.ndim == 4 else -1
    if not held == layer.offset == header.prompt_length:
        raise MalformedHandoff(
            f"layer {index}: a delta needs the whole prompt's {header.prompt_length} positions, "
            f"the layer holds {held} for offset {layer.offset}"
        )
    return dataclasses.replace(
        layer, keys=layer.keys[:, :, prefix:], values=layer.values[:, :, prefix:]
    )


def check_delta_begin(header: HandoffHeader) -> None:
    """Receiver: a delta is only for models whose every layer can be cut at a position."""
    if header.prefix_tokens and not can_ship_delta(header.fingerprint):
        raise UnsupportedCacheKind("a delta handoff needs plain KVCache layers only")


def check_delta_layer(index: int, descriptor: LayerDescriptor, header: HandoffHeader) -> None:
    """Receiver: a delta's layer holds exactly the positions after the prefix."""
    if not header.prefix_tokens:
        return
    want = (header.shipped_tokens, header.prompt_length)
    if (descriptor.tokens, descriptor.offset) != want:
        raise MalformedHandoff(
            f"layer {index}: a delta after {header.prefix_tokens} prefix tokens holds "
            f"{want[0]} positions to offset {want[1]}, not {descriptor.tokens} to "
            f"{descriptor.offset}"
        )
