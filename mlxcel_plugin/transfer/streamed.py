"""StreamedTransfer: each layer's chunks as soon as ``on_layer`` delivers it."""

from __future__ import annotations

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_serde import HandoffHeader, KVMessage
from mlxcel_plugin.transfer.base import WriterStrategy


class StreamedTransfer(WriterStrategy):
    """begin at ``start``, chunks per layer, end at ``finish`` — all on lane 0.

    MLX evaluates layer caches one at a time, so layer i is on the wire while
    layer i+1 computes; the begin header needs no layer shapes for this.
    """

    name = "streamed"
    overlaps_prefill = True

    def start(self, header: HandoffHeader) -> list[KVMessage]:
        return [self._start_writer(header).begin()]

    def add_layer(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        return self._live_writer().layer(index, layer)

    def finish(self) -> list[KVMessage]:
        return [self._finish_writer().end()]
