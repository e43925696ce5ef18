"""FullTransfer: the whole cache after prefill, one message set on one lane."""

from __future__ import annotations

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_serde import HandoffHeader, KVMessage
from mlxcel_plugin.transfer.base import StrategyOptions, WriterStrategy


class FullTransfer(WriterStrategy):
    """Holds layers until ``finish``, then emits begin, every chunk, end.

    Simplest and lowest-overhead; right for small payloads, where overlapping
    transfer with compute saves nothing.
    """

    name = "full"

    def __init__(self, options: StrategyOptions | None = None):
        super().__init__(options)
        self._layers: dict[int, CacheLayer] = {}

    def start(self, header: HandoffHeader) -> list[KVMessage]:
        self._start_writer(header)
        return []

    def add_layer(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        self._live_writer()
        # Keep a reference only; encoding waits for finish().
        self._layers[index] = layer
        return []

    def finish(self) -> list[KVMessage]:
        writer = self._finish_writer()
        messages = [writer.begin()]
        for index in sorted(self._layers):
            messages.extend(writer.layer(index, self._layers[index]))
        self._layers.clear()
        messages.append(writer.end())
        return messages
