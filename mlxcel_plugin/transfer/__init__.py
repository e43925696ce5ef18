"""KV transfer: strategies (when/which lane), bandwidth estimates, adaptive choice."""

from mlxcel_plugin.transfer.bandwidth import BandwidthEstimator
from mlxcel_plugin.transfer.base import (
    StrategyFactory,
    StrategyOptions,
    TransferStrategy,
    WriterStrategy,
    make_strategy,
    plan_transfer,
    sends_rows_ahead,
)
from mlxcel_plugin.transfer.config import AUTO, TransferConfig
from mlxcel_plugin.transfer.full import FullTransfer
from mlxcel_plugin.transfer.layer_parallel import LayerParallelTransfer
from mlxcel_plugin.transfer.selector import AdaptiveSelector, SelectorTuning, TransferChoice
from mlxcel_plugin.transfer.streamed import StreamedTransfer

__all__ = [
    "AUTO",
    "AdaptiveSelector",
    "BandwidthEstimator",
    "FullTransfer",
    "LayerParallelTransfer",
    "SelectorTuning",
    "StrategyFactory",
    "StrategyOptions",
    "StreamedTransfer",
    "TransferChoice",
    "TransferConfig",
    "TransferStrategy",
    "WriterStrategy",
    "make_strategy",
    "plan_transfer",
    "sends_rows_ahead",
]
