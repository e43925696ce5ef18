"""KV that converts across a handoff: another float dtype, or a receiver that quantizes.

Two nodes of one model may keep its K/V differently: one prefills in float32
(a Linux box), the other decodes in float16 or bfloat16 (a Mac), or runs
``[engine] kv_bits`` (mlx-lm's ``QuantizedKVCache``). These differences are
converted, not refused (docs/compatibility.md):

* **dtype**: cast on whichever side keeps the wire smaller. A sender whose dtype
  is at least as wide as the receiver's casts before sending (``wire_dtype``,
  ``CastingStrategy``: the wire carries the receiver's dtype); a narrower sender's
  K/V travel as they are and the receiver widens them on arrival (exact:
  float16 and bfloat16 are float32 values).
* **kv_bits**: a plain-KV sender's K/V are quantized by the receiver on arrival,
  as a ``kv_bits`` node quantizes its own prompt's K/V once prefill ends.

The receiver assembles a converting handoff against the *sender's* description
(``Arrival.fingerprint_for``): its receive buffers are in the sender's dtype and
form, and the engine converts the whole cache once before decoding. Packed
(quantized) K/V are never re-cast or re-quantized: those stay refused, as do
other layer counts, heads, head_dim and cache kinds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

# UNQUANTIZED: where a kv_bits engine's fingerprint keeps its plain layers.
from mlxcel_plugin.compatibility import UNQUANTIZED
from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_codecs import TENSOR_DTYPES, from_float32, storage_dtype, to_float32
from mlxcel_plugin.kv_serde.header import HandoffHeader, ModelFingerprint
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec, LayerSpec
from mlxcel_plugin.kv_serde.messages import KVMessage

QUANTIZED_KIND = "QuantizedKVCache"


def cast_array(array: np.ndarray, source: str, target: str) -> np.ndarray:
    """``array`` (``source``'s storage: bfloat16 as uint16 bits) in ``target``'s storage.

    Widening (float16/bfloat16 to float32) is exact; narrowing rounds to nearest even.
    """
    if source == target:
        return array
    if source == "float32" and target == "float16":
        return np.asarray(array).astype("<f2")
    return from_float32(to_float32(np.asarray(array), source), target)


def cast_layer(layer: CacheLayer, target: str) -> CacheLayer:
    """A layer with every array of its own dtype in ``target`` (packed words stay as they are)."""
    if layer.dtype == target or layer.kind == QUANTIZED_KIND:
        return layer
    stored = storage_dtype(layer.dtype)
    arrays = {name: cast_array(a, layer.dtype, target) if a.dtype == stored else a
              for name, a in layer.arrays().items()}
    return CacheLayer.of_arrays(layer.kind, arrays, target, layer.offset, layer.meta)


def cast_rows(arrays: Mapping[str, Any], source: str, target: str) -> dict[str, Any]:
    """A prefill cell's rows (plain K/V in ``source``) in ``target``."""
    return {name: cast_array(a, source, target) for name, a in arrays.items()}


def _cast_spec(spec: ArraySpec, source: str, target: str) -> ArraySpec:
    return dataclasses.replace(spec, dtype=target) if spec.dtype == source else spec


def cast_fingerprint(fingerprint: ModelFingerprint, target: str) -> ModelFingerprint:
    """The fingerprint of the same K/V kept in ``target`` (what a cast sender announces)."""
    source = fingerprint.dtype
    if source == target:
        return fingerprint
    layers = tuple(layer if layer.kind == QUANTIZED_KIND else LayerSpec(
        layer.kind, tuple(_cast_spec(a, source, target) for a in layer.arrays))
        for layer in fingerprint.layers)
    return dataclasses.replace(fingerprint, dtype=target, layers=layers)


def wire_dtype(sender: str, receiver: str) -> str:
    """The dtype a handoff travels in: the receiver's unless it is wider than the sender's."""
    if receiver not in TENSOR_DTYPES or sender not in TENSOR_DTYPES:
        return sender
    wider = storage_dtype(receiver).itemsize > storage_dtype(sender).itemsize
    return sender if wider else receiver


def plain_fingerprint(fingerprint: Mapping[str, Any]) -> ModelFingerprint | None:
    """A kv_bits engine's layers as prefill computes them (None: the engine keeps plain K/V)."""
    plain = fingerprint.get(UNQUANTIZED)
    if not isinstance(plain, Mapping):
        return None
    return ModelFingerprint.from_dict({**fingerprint, **plain})


def _matches(sent: ModelFingerprint, held: ModelFingerprint) -> bool:
    try:
        sent.check_matches(held)
    except Exception:  # noqa: BLE001 - any mismatch: not this form
        return False
    return True


class Arrival:
    """What a receiver takes: its own form, or one it converts from (dtype, quantizing)."""

    def __init__(self, local: ModelFingerprint, plain: ModelFingerprint | None = None):
        self.local, self.plain = local, plain

    def fingerprint_for(self, sent: ModelFingerprint) -> ModelFingerprint:
        """The fingerprint to assemble ``sent``'s handoff against; raises its mismatch.

        ``self.local`` when the K/V arrive as this engine keeps them, else ``sent``
        itself when the engine converts it (another dtype; plain K/V it quantizes).
        """
        if _matches(sent, self.local):
            return self.local
        for form in (self.local, self.plain):
            if form is None or QUANTIZED_KIND in sent.cache_classes and sent.dtype != form.dtype:
                continue
            if _matches(cast_fingerprint(sent, form.dtype), form):
                return sent
        sent.check_matches(self.local)  # raises the mismatch a receiver always named
        return self.local  # only reachable through a bug: check_matches found none


def converts(sent: ModelFingerprint, held: ModelFingerprint) -> str:
    """How a handoff is converted on arrival, for logs and metrics ("" when it is not)."""
    steps = []
    if sent.dtype != held.dtype:
        steps.append(f"{sent.dtype}->{held.dtype}")
    if QUANTIZED_KIND not in sent.cache_classes and QUANTIZED_KIND in held.cache_classes:
        steps.append("quantize")
    return "+".join(steps)


class CastingStrategy:
    """A transfer strategy whose K/V go out in ``target``: the sender's side of a dtype cast.

    The casts run where the strategy's calls run (the prefill node's encoder
    thread), not on the event loop. The header's fingerprint is cast too, so
    the receiver sees K/V in its own dtype and needs no conversion.
    """

    def __init__(self, inner: Any, source: str, target: str):
        self.inner, self.source, self.target = inner, source, target
        self.name = getattr(inner, "name", "cast")

    def start(self, header: HandoffHeader) -> list[KVMessage]:
        cast = dataclasses.replace(header, fingerprint=cast_fingerprint(header.fingerprint,
                                                                        self.target))
        return self.inner.start(cast)

    def add_layer(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        return self.inner.add_layer(index, cast_layer(layer, self.target))

    def finish(self) -> list[KVMessage]:
        return self.inner.finish()


class CastingRowsStrategy(CastingStrategy):
    """``CastingStrategy`` of a strategy that sends prefill cells' rows ahead of layers."""

    def add_rows(self, index: int, first_token: int, arrays: Mapping[str, Any]) -> list[KVMessage]:
        return self.inner.add_rows(index, first_token, cast_rows(arrays, self.source, self.target))


def casting(strategy: Any, source: str, target: str) -> Any:
    """``strategy`` sending in ``target`` (itself when nothing is cast)."""
    if source == target:
        return strategy
    kind = CastingRowsStrategy if hasattr(strategy, "add_rows") else CastingStrategy
    return kind(strategy, source, target)


def receiving_forms(fingerprint: Mapping[str, Any]) -> tuple[ModelFingerprint,
                                                            ModelFingerprint | None]:
    """A decode engine's fingerprint as it keeps K/V, and its plain form when it quantizes."""
    return ModelFingerprint.from_dict(fingerprint), plain_fingerprint(fingerprint)
