"""A handoff as one value: the begin header plus the cache it carries."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel_plugin.engine_api import CacheState
from mlxcel_plugin.kv_codecs import KVCodec
from mlxcel_plugin.kv_serde.header import HandoffHeader
from mlxcel_plugin.kv_serde.messages import KVMessage
from mlxcel_plugin.kv_serde.writer import DEFAULT_CHUNK_BYTES, KVWriter


@dataclass
class SerializableCacheState:
    """What the sender hands off and what the receiver's KVAssembler yields."""

    header: HandoffHeader
    cache: CacheState

    def to_messages(
        self, codec: KVCodec, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> list[KVMessage]:
        """begin, every chunk in layer order, end (what FullTransfer sends on one lane)."""
        writer = KVWriter(self.header, codec, chunk_bytes)
        messages = [writer.begin()]
        for index, layer in enumerate(self.cache.layers):
            messages.extend(writer.layer(index, layer))
        messages.append(writer.end())
        return messages
