"""The TransferStrategy interface: when, and on which lane, each KV message goes.

A strategy is a sans-I/O planner for one handoff: it knows nothing about
sockets. The caller sends each returned message on ``links[message.lane]``
in the order returned (the order matters per lane; lanes are independent).
A prefill node makes one handoff's calls in order, one at a time, on its
``kv-encode`` thread (``nodes/handoff_sender``), so the encoding they do
never holds up the event loop; a strategy keeps to its own state.

A strategy may also offer ``add_rows(index, first_token, arrays)``: a prefill
cell's K/V of one layer (``{"k", "v"}``, ``[1, kv_heads, n, head_dim]``) as soon
as its forward is done, before the layer's own ``add_layer``
(``kv_serde.early_rows``); the node then hands it every cell as it comes.

    strategy = factory(StrategyOptions(codec=codec, chunk_bytes=..., lanes=...))
    send(strategy.start(header))
    for i, layer in layers_as_they_are_evaluated:   # engine's on_layer
        send(strategy.add_layer(i, layer))
    send(strategy.finish())

A strategy may also offer ``prefill_ended()``: called on the node's event loop
the moment the prefill is over, while its layers may still be encoding on the
``kv-encode`` thread (``FullTransfer`` then sends each as soon as it is encoded).
It may only set state that the encoder-thread calls read.

What the AdaptiveSelector may pick a strategy for, it reads from two class
attributes of the registered factory (``WriterStrategy`` sets both False):
``overlaps_prefill`` (sends each layer while the next computes, so it needs a
live prefill) and ``spreads_over_lanes`` (deals messages over
``options.lanes`` links). A factory without them is only used when configured
by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mlxcel_plugin.engine_api import CacheLayer, CacheState
from mlxcel_plugin.errors import PluginError
from mlxcel_plugin.kv_codecs import IdentityCodec, KVCodec, resolve_codec
from mlxcel_plugin.kv_serde import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    HandoffHeader,
    KVMessage,
    KVWriter,
    UnexpectedMessage,
)


@dataclass(frozen=True)
class StrategyOptions:
    codec: KVCodec = IdentityCodec()
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    lanes: int = 1  # links available to this handoff; only LayerParallel uses more than one
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@runtime_checkable
class TransferStrategy(Protocol):
    name: str

    def start(self, header: HandoffHeader) -> list[KVMessage]: ...

    def add_layer(self, index: int, layer: CacheLayer) -> list[KVMessage]: ...

    def finish(self) -> list[KVMessage]: ...


StrategyFactory = Callable[[StrategyOptions], TransferStrategy]


class WriterStrategy:
    """Shared plumbing: one KVWriter per handoff, started once, finished once."""

    name = "abstract"
    overlaps_prefill = False
    spreads_over_lanes = False

    def __init__(self, options: StrategyOptions | None = None):
        self.options = options or StrategyOptions()
        self._writer: KVWriter | None = None
        self._finished = False

    def _start_writer(self, header: HandoffHeader) -> KVWriter:
        if self._writer is not None:
            raise UnexpectedMessage(f"{self.name}: start() called twice")
        self._writer = KVWriter(
            header, self.options.codec, self.options.chunk_bytes, self.options.max_body_bytes
        )
        return self._writer

    def _live_writer(self) -> KVWriter:
        if self._writer is None or self._finished:
            raise UnexpectedMessage(f"{self.name}: not started, or already finished")
        return self._writer

    def _finish_writer(self) -> KVWriter:
        writer = self._live_writer()
        self._finished = True
        return writer


def plan_transfer(
    strategy: TransferStrategy, header: HandoffHeader, cache: CacheState
) -> list[KVMessage]:
    """Every message for a cache that is already complete, in send order."""
    messages = list(strategy.start(header))
    for index, layer in enumerate(cache.layers):
        messages.extend(strategy.add_layer(index, layer))
    messages.extend(strategy.finish())
    return messages


def sends_rows_ahead(strategy: object) -> bool:
    """Whether a strategy (or its factory) offers ``add_rows``: cells' rows before layers."""
    return hasattr(strategy, "add_rows")


def make_strategy(
    strategy: str,
    codec: str,
    strategies: Mapping[str, StrategyFactory],
    codecs: Mapping[str, KVCodec],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    lanes: int = 1,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> TransferStrategy:
    """A fresh strategy for one handoff, by registered names (e.g. from a TransferChoice)."""
    if strategy not in strategies:
        known = ", ".join(sorted(strategies)) or "none"
        raise PluginError(f"unknown transfer_strategy {strategy!r}; registered: {known}")
    options = StrategyOptions(resolve_codec(codec, codecs), chunk_bytes, lanes, max_body_bytes)
    return strategies[strategy](options)
