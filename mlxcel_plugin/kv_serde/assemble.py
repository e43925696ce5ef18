"""A whole handoff's messages assembled at once (tests, and engines checking a round trip)."""

from __future__ import annotations

from collections.abc import Mapping

from mlxcel_plugin.kv_codecs import KVCodec
from mlxcel_plugin.kv_serde.assembler import KVAssembler
from mlxcel_plugin.kv_serde.errors import TruncatedLayer
from mlxcel_plugin.kv_serde.header import ModelFingerprint
from mlxcel_plugin.kv_serde.limits import AssemblerLimits
from mlxcel_plugin.kv_serde.messages import KVMessage
from mlxcel_plugin.kv_serde.state import SerializableCacheState


def assemble_messages(messages: list[KVMessage], local: ModelFingerprint,
                      codecs: Mapping[str, KVCodec],
                      limits: AssemblerLimits | None = None) -> SerializableCacheState:
    """Feed a complete message list (in arrival order) and return the handoff."""
    assembler = KVAssembler(local, codecs, limits)
    result = None
    for message in messages:
        result = assembler.feed(message) or result
    if result is None:
        raise TruncatedLayer(f"handoff incomplete: {assembler.progress()}")
    return result
