"""StreamedTransfer: each layer's chunks as soon as ``on_layer`` delivers it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_serde import HandoffHeader, KVMessage
from mlxcel_plugin.transfer.base import WriterStrategy


class StreamedTransfer(WriterStrategy):
    """begin at ``start``, chunks per layer, end at ``finish`` — all on lane 0.

    MLX evaluates layer caches one at a time, so layer i is on the wire while
    layer i+1 computes; the begin header needs no layer shapes for this. With
    ``add_rows``, each prefill cell's rows go after its forward (``early_rows``),
    and a layer then sends only what is left of it.
    """

    name = "streamed"
    overlaps_prefill = True

    def start(self, header: HandoffHeader) -> list[KVMessage]:
        return [self._start_writer(header).begin()]

    def add_layer(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        return self._live_writer().layer(index, layer)

    def add_rows(self, index: int, first_token: int, arrays: Mapping[str, Any]
                 ) -> list[KVMessage]:
        return self._live_writer().rows(index, first_token, arrays)

    def finish(self) -> list[KVMessage]:
        return [self._finish_writer().end()]
