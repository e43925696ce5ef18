"""BandwidthEstimator: per-peer EWMA of measured bytes/s from real transfers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mlxcel_plugin.transfer.pacing import LINK

Clock = Callable[[], float]


@dataclass
class _PeerEstimate:
    bytes_per_s: float
    samples: int
    updated_at: float
    paced_by: str = LINK  # who set the newest sample's pace (transfer/pacing.py)


class BandwidthEstimator:
    """Fed ``observe(peer, nbytes, seconds)`` after each handoff (or large chunk).

    Small transfers are ignored: latency, not bandwidth, dominates them. An
    estimate older than ``stale_after_s`` is dropped — links and load change,
    and a stale number is worse than the selector's prior. A sample more than
    ``jump_factor`` away from the estimate (either way) replaces it: the link
    changed (a rate cut, a congested path), and averaging would take a dozen
    mis-planned handoffs to notice.

    A sample the sender or the receiver paced, not the link (``transfer/pacing.py``), says
    only that the link is at least that fast: it raises an estimate below it and never
    lowers one, and marks the peer as paced so until a sample the link paced comes, which
    then replaces the estimate (a bound is not a measurement to average with).
    """

    def __init__(
        self,
        *,
        alpha: float = 0.3,
        min_sample_bytes: int = 256 * 1024,
        stale_after_s: float = 600.0,
        jump_factor: float = 4.0,
        clock: Clock = time.monotonic,
    ):
        self.alpha = alpha
        self.min_sample_bytes = min_sample_bytes
        self.stale_after_s = stale_after_s
        self.jump_factor = jump_factor
        self.clock = clock
        self._peers: dict[str, _PeerEstimate] = {}

    def observe(self, peer: str, nbytes: int, seconds: float, *, paced_by: str = LINK) -> None:
        if nbytes < self.min_sample_bytes or seconds <= 0:
            return
        sample = nbytes / seconds
        now = self.clock()
        current = self._fresh(peer, now)
        if paced_by != LINK:
            self._observe_floor(peer, sample, now, current, paced_by)
            return
        if current is None or current.paced_by != LINK or self._jumped(current.bytes_per_s,
                                                                         sample):
            self._peers[peer] = _PeerEstimate(sample, 1, now)
            return
        current.bytes_per_s += self.alpha * (sample - current.bytes_per_s)
        current.samples += 1
        current.updated_at = now

    def _observe_floor(self, peer: str, floor: float, now: float,
                       current: _PeerEstimate | None, paced_by: str) -> None:
        if current is None or current.bytes_per_s < floor:
            samples = 1 if current is None else current.samples + 1
            self._peers[peer] = _PeerEstimate(floor, samples, now, paced_by)
            return
        current.paced_by = paced_by

    def paced_by(self, peer: str) -> str:
        """Who set the pace of the newest fresh sample to ``peer`` (``LINK`` when none)."""
        current = self._fresh(peer, self.clock())
        return LINK if current is None else current.paced_by

    def _jumped(self, estimate: float, sample: float) -> bool:
        return sample > estimate * self.jump_factor or sample * self.jump_factor < estimate

    def estimate(self, peer: str) -> float | None:
        """Bytes/s to ``peer``, or None before any (fresh) measurement."""
        current = self._fresh(peer, self.clock())
        return None if current is None else current.bytes_per_s

    def snapshot(self) -> dict[str, dict[str, float | int | str]]:
        """Fresh estimates by peer, for stats and logs."""
        now = self.clock()
        return {
            peer: {
                "bytes_per_s": est.bytes_per_s,
                "samples": est.samples,
                "age_s": now - est.updated_at,
                "paced_by": est.paced_by,
            }
            for peer, est in self._peers.items()
            if now - est.updated_at <= self.stale_after_s
        }

    def _fresh(self, peer: str, now: float) -> _PeerEstimate | None:
        current = self._peers.get(peer)
        if current is not None and now - current.updated_at > self.stale_after_s:
            del self._peers[peer]
            return None
        return current
