"""BandwidthEstimator: per-peer EWMA of measured bytes/s from real transfers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass
class _PeerEstimate:
    bytes_per_s: float
    samples: int
    updated_at: float
    receiver_paced: bool = False  # the newest sample: the receiver, not the link, set its pace


class BandwidthEstimator:
    """Fed ``observe(peer, nbytes, seconds)`` after each handoff (or large chunk).

    Small transfers are ignored: latency, not bandwidth, dominates them. An
    estimate older than ``stale_after_s`` is dropped — links and load change,
    and a stale number is worse than the selector's prior. A sample more than
    ``jump_factor`` away from the estimate (either way) replaces it: the link
    changed (a rate cut, a congested path), and averaging would take a dozen
    mis-planned handoffs to notice.

    A ``receiver_paced`` sample (the decode node's readers were busy for most of it:
    ``link/read_load.py``) says only that the link is at least that fast: it raises an
    estimate below it and never lowers one, and marks the peer receiver-paced until a
    sample the link paced comes, which then replaces the estimate (a bound is not a
    measurement to average with).
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

    def observe(self, peer: str, nbytes: int, seconds: float, *,
                receiver_paced: bool = False) -> None:
        if nbytes < self.min_sample_bytes or seconds <= 0:
            return
        sample = nbytes / seconds
        now = self.clock()
        current = self._fresh(peer, now)
        if receiver_paced:
            self._observe_floor(peer, sample, now, current)
            return
        if current is None or current.receiver_paced or self._jumped(current.bytes_per_s,
                                                                       sample):
            self._peers[peer] = _PeerEstimate(sample, 1, now)
            return
        current.bytes_per_s += self.alpha * (sample - current.bytes_per_s)
        current.samples += 1
        current.updated_at = now
        current.receiver_paced = False

    def _observe_floor(self, peer: str, floor: float, now: float,
                       current: _PeerEstimate | None) -> None:
        if current is None or current.bytes_per_s < floor:
            samples = 1 if current is None else current.samples + 1
            self._peers[peer] = _PeerEstimate(floor, samples, now, receiver_paced=True)
            return
        current.receiver_paced = True

    def receiver_paced(self, peer: str) -> bool:
        """Whether the newest fresh sample to ``peer`` was paced by the receiver."""
        current = self._fresh(peer, self.clock())
        return current is not None and current.receiver_paced

    def _jumped(self, estimate: float, sample: float) -> bool:
        return sample > estimate * self.jump_factor or sample * self.jump_factor < estimate

    def estimate(self, peer: str) -> float | None:
        """Bytes/s to ``peer``, or None before any (fresh) measurement."""
        current = self._fresh(peer, self.clock())
        return None if current is None else current.bytes_per_s

    def snapshot(self) -> dict[str, dict[str, float | int | bool]]:
        """Fresh estimates by peer, for stats and logs."""
        now = self.clock()
        return {
            peer: {
                "bytes_per_s": est.bytes_per_s,
                "samples": est.samples,
                "age_s": now - est.updated_at,
                "receiver_paced": est.receiver_paced,
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
