"""AdaptiveSelector: strategy + codec from payload size and estimated bandwidth.

Pure and deterministic: the caller passes the bandwidth estimate (from
BandwidthEstimator) and logs ``TransferChoice.as_dict()``.

It chooses among the strategies it is given (the plugin registry's
``transfer_strategy`` entries) by what each declares (``overlaps_prefill``,
``spreads_over_lanes``; see ``transfer.base``), never by name: one that sends a
complete cache on one lane, one that streams layers on one lane, one that
spreads over several lanes. Several of a kind: the first by name.

Cost model per codec: a handoff moves in chunks (``record_chunk_bytes``), and while
one chunk is on the wire the sender encodes the next and the receiver decodes
the last one, so the slowest of the three stages sets the pace and the other
two add one chunk's worth (filling and draining the pipeline)::

    stages = (payload/encode_rate, payload/ratio/bandwidth, payload/decode_rate)
    estimate = max(stages) + (sum(stages) - max(stages)) / chunks

Measured over 1 Gbit/s between network namespaces (``loadtests/bench_network.py``):
int8 hands SmolLM2's fp32 KV over in less than half the time of raw bytes,
which a serial sum of the stages ranked the other way round.

Where the sender or the receiver, not the link, set the last handoff's pace
(``paced_by``, transfer/pacing.py), the wire stage is not what limits, and a codec
only adds encoding or decoding to the side that does: ``auto`` then sends raw bytes.
The measured figure is then a floor on the link: one below the prior leaves the prior.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mlxcel_plugin.errors import PluginError
from mlxcel_plugin.kv_codecs import KVCodec, UnknownCodec, resolve_codec
from mlxcel_plugin.transfer.base import StrategyFactory
from mlxcel_plugin.transfer.config import AUTO, TransferConfig
from mlxcel_plugin.transfer.pacing import LINK


@dataclass(frozen=True)
class SelectorTuning:
    # Until a peer is measured: ≈ websockets + AES-GCM on loopback (docs/design.md).
    prior_bytes_per_s: float = 400e6
    # At most this much, one message set is as good as streaming.
    small_payload_bytes: int = 4 << 20
    # Extra links only pay off when the wire time is at least this long.
    parallel_min_s: float = 0.05
    # Lossy ones (int8) are candidates only with ``allow_lossy``.
    auto_codecs: tuple[str, ...] = ("none", "lz4", "shuffle+lz4", "int8")
    # A codec's encode and decode share the cores with prefill and decode, which the
    # pipeline estimate leaves out: it must beat the cheapest candidate by this fraction.
    min_codec_gain: float = 0.1
    # Weight of the newest handoff in a codec's measured compression ratio.
    ratio_weight: float = 0.3


@dataclass(frozen=True)
class TransferChoice:
    strategy: str
    codec: str
    lanes: int
    reason: str
    payload_bytes: int
    bandwidth_bytes_per_s: float
    bandwidth_source: str  # "measured" or "prior"
    estimated_s: dict[str, float] = field(default_factory=dict)  # by candidate codec
    paced_by: str = LINK  # not "link": the bandwidth is a floor that side's pace set

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _traits(factory: StrategyFactory) -> tuple[bool, bool] | None:
    """``(overlaps_prefill, spreads_over_lanes)``, or None when the factory declares neither."""
    if not (hasattr(factory, "overlaps_prefill") and hasattr(factory, "spreads_over_lanes")):
        return None
    return bool(factory.overlaps_prefill), bool(factory.spreads_over_lanes)


def _first_with(strategies: Mapping[str, StrategyFactory], traits: tuple[bool, bool]) -> str | None:
    return next((name for name in sorted(strategies) if _traits(strategies[name]) == traits), None)


WHOLE_CACHE = (False, False)  # everything at finish(), one lane
STREAMING = (True, False)  # each layer as it is evaluated, one lane
LANES = (True, True)  # each layer as it is evaluated, dealt over several lanes


class AdaptiveSelector:
    def __init__(
        self,
        config: TransferConfig,
        strategies: Mapping[str, StrategyFactory],
        codecs: Mapping[str, KVCodec],
        tuning: SelectorTuning | None = None,
    ):
        known = ", ".join(sorted(strategies)) or "none"
        if config.strategy != AUTO and config.strategy not in strategies:
            raise PluginError(f"unknown transfer_strategy {config.strategy!r}; registered: {known}")
        whole = _first_with(strategies, WHOLE_CACHE)
        if whole is None:  # a cache that is already complete needs one
            raise PluginError(f"no registered transfer_strategy sends a complete cache: {known}")
        self.config, self.strategies, self.codecs = config, strategies, codecs
        self.whole_cache_strategy = whole
        self._streaming = _first_with(strategies, STREAMING)
        self._lanes = _first_with(strategies, LANES)
        self.tuning = tuning or SelectorTuning()
        self._ratios: dict[str, float] = {}  # codec -> measured raw/wire bytes (moving)

    def observe_ratio(self, codec: str, raw_bytes: int, wire_bytes: int) -> None:
        """What ``codec`` achieved on one handoff; replaces its profile's guess from now on.

        KV caches compress far less than a profile may assume (floats are nearly
        incompressible); without this, a slow-looking link would keep paying
        encode and decode CPU for nothing.
        """
        if raw_bytes <= 0 or wire_bytes <= 0:
            return
        ratio, weight = raw_bytes / wire_bytes, self.tuning.ratio_weight
        old = self._ratios.get(codec)
        self._ratios[codec] = ratio if old is None else (1 - weight) * old + weight * ratio

    def ratio(self, codec: KVCodec) -> float:
        """The measured ratio when there is one, else the codec's profile."""
        return self._ratios.get(codec.name, codec.profile.ratio)

    def select(
        self,
        payload_bytes: int,
        bandwidth_bytes_per_s: float | None,
        *,
        lanes_available: int = 1,
        can_stream: bool = True,
        paced_by: str = LINK,
    ) -> TransferChoice:
        """Choose for one handoff of ``payload_bytes`` raw K/V bytes.

        ``can_stream=False``: the cache is already complete, so the choice is a
        strategy that sends it whole on one lane. ``paced_by`` other than ``LINK``: the
        bandwidth is only a floor, that side's pace (module docstring).
        """
        measured = bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s > 0
        bandwidth = bandwidth_bytes_per_s if measured else self.tuning.prior_bytes_per_s
        paced_by = paced_by if measured else LINK
        if paced_by != LINK and bandwidth < self.tuning.prior_bytes_per_s:
            bandwidth, measured = self.tuning.prior_bytes_per_s, False  # the link: at least that
        estimates = self._estimates(payload_bytes, bandwidth)
        codec, codec_reason = self._codec(estimates, paced_by)
        wire_s = estimates.get(codec, payload_bytes / bandwidth)
        lanes = min(self.config.parallelism, max(1, lanes_available))
        strategy, strategy_reason = self._strategy(payload_bytes, wire_s, lanes, can_stream)
        return TransferChoice(
            strategy=strategy,
            codec=codec,
            lanes=lanes if self._spreads_over_lanes(strategy) else 1,
            reason=f"{strategy_reason}; {codec_reason}",
            payload_bytes=payload_bytes,
            bandwidth_bytes_per_s=bandwidth,
            bandwidth_source="measured" if measured else "prior",
            estimated_s=estimates,
            paced_by=paced_by,
        )

    def _candidates(self) -> Sequence[KVCodec]:
        found = []
        for name in self.tuning.auto_codecs:
            try:
                codec = resolve_codec(name, self.codecs)
            except UnknownCodec:
                continue  # a candidate this node lacks is simply not a candidate
            if codec.lossless or self.config.allow_lossy:
                found.append(codec)
        return found

    def _estimates(self, payload_bytes: int, bandwidth: float) -> dict[str, float]:
        chunks = max(1.0, payload_bytes / self.config.record_chunk_bytes)
        estimates = {}
        for codec in self._candidates():
            stages = (payload_bytes / codec.profile.encode_bytes_per_s,
                      payload_bytes / self.ratio(codec) / bandwidth,
                      payload_bytes / codec.profile.decode_bytes_per_s)
            slowest = max(stages)
            estimates[codec.name] = slowest + (sum(stages) - slowest) / chunks
        return estimates

    def _codec(self, estimates: Mapping[str, float], paced_by: str) -> tuple[str, str]:
        if self.config.codec != AUTO:
            return self.config.codec, "codec configured"
        if not estimates:
            return "none", "no auto codec candidates"
        if paced_by != LINK:
            return "none", f"codec none: the {paced_by}, not the link, set the last pace"
        # Candidates are listed cheapest first; min() keeps the first of equal estimates.
        cheapest = next(iter(estimates))
        best = min(estimates, key=estimates.__getitem__)
        if estimates[best] > estimates[cheapest] * (1 - self.tuning.min_codec_gain):
            best = cheapest
        return best, f"codec {best} fastest by estimate"

    def _spreads_over_lanes(self, strategy: str) -> bool:
        return (_traits(self.strategies[strategy]) or WHOLE_CACHE)[1]

    def _strategy(
        self, payload_bytes: int, wire_s: float, lanes: int, can_stream: bool
    ) -> tuple[str, str]:
        configured = self.config.strategy
        if configured != AUTO:
            if can_stream or _traits(self.strategies[configured]) == WHOLE_CACHE:
                return configured, "strategy configured"
            return self.whole_cache_strategy, f"cache already complete ({configured} streams)"
        if not can_stream:
            return self.whole_cache_strategy, "cache already complete"
        if payload_bytes <= self.tuning.small_payload_bytes:
            return self.whole_cache_strategy, "small payload"
        if self._lanes and lanes > 1 and wire_s >= self.tuning.parallel_min_s:
            return self._lanes, f"{wire_s:.3f}s on the wire, {lanes} links"
        if self._streaming:
            return self._streaming, "overlap transfer with prefill"
        return self.whole_cache_strategy, "no streaming strategy registered"
