"""FullTransfer: the whole cache after prefill, one message set on one lane."""

from __future__ import annotations

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_serde import HandoffHeader, KVMessage
from mlxcel_plugin.transfer.base import StrategyOptions, WriterStrategy


class FullTransfer(WriterStrategy):
    """Holds every message until ``finish``, then emits begin, every chunk, end.

    Simplest and lowest-overhead; right for small payloads, where overlapping
    transfer with compute saves nothing. Each layer is still encoded (sliced,
    checksummed) as it arrives, while prefill computes the next, so ``finish``
    only has to emit: the first byte goes out without a checksum pass first.
    """

    name = "full"

    def __init__(self, options: StrategyOptions | None = None):
        super().__init__(options)
        self._chunks: dict[int, list[KVMessage]] = {}

    def start(self, header: HandoffHeader) -> list[KVMessage]:
        self._start_writer(header)
        return []

    def add_layer(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        self._chunks[index] = self._live_writer().layer(index, layer)
        return []

    def finish(self) -> list[KVMessage]:
        writer = self._finish_writer()
        chunks = [chunk for index in sorted(self._chunks) for chunk in self._chunks[index]]
        self._chunks.clear()
        return [writer.begin(), *chunks, writer.end()]
