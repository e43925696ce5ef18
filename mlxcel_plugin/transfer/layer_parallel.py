"""LayerParallelTransfer: layers round-robin over several links."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_serde import HandoffHeader, KVMessage
from mlxcel_plugin.transfer.base import StrategyOptions, WriterStrategy


class LayerParallelTransfer(WriterStrategy):
    """Streams like StreamedTransfer, dealing layers over ``options.lanes`` links.

    A layer's chunks stay on one lane, so they can share a frame there
    (``kv_wire.frames_for``); consecutive layers go to different lanes.

    Every lane gets its own copy of begin first, so on any lane the receiver
    sees begin before that lane's chunks; the receiver places chunks in any
    order. end goes on lane 0 and may overtake chunks on other lanes — the
    assembler waits for the count end declares.
    """

    name = "layer-parallel"
    overlaps_prefill = True
    spreads_over_lanes = True

    def __init__(self, options: StrategyOptions | None = None):
        super().__init__(options)
        self._next_lane = 0

    def start(self, header: HandoffHeader) -> list[KVMessage]:
        begin = self._start_writer(header).begin()
        return [dataclasses.replace(begin, lane=lane) for lane in range(self.options.lanes)]

    def add_layer(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        lane = self._next_lane
        self._next_lane = (lane + 1) % self.options.lanes
        chunks = self._live_writer().layer(index, layer)
        return [dataclasses.replace(chunk, lane=lane) for chunk in chunks]

    def add_rows(self, index: int, first_token: int, arrays: Mapping[str, Any]
                 ) -> list[KVMessage]:
        """A cell's rows ahead of their layer, on the lane of the layer's index."""
        lane = index % self.options.lanes
        chunks = self._live_writer().rows(index, first_token, arrays)
        return [dataclasses.replace(chunk, lane=lane) for chunk in chunks]

    def finish(self) -> list[KVMessage]:
        return [self._finish_writer().end()]
