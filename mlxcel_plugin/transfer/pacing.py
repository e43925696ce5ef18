"""Who set a handoff's pace: the link, the sender or the receiver.

A handoff's bytes over its time measure the link only where the link held it back.
Where the sender did (prefill, its event loop, a CPU shared with other work: the link's
connections sat idle for much of the window) or the receiver did (the decode node's
readers busy, or its receive window full), the figure is only a floor on the link's
speed, and a codec chosen on it would add CPU to the side already short of it
(docs/bulk-lanes.md#who-set-the-pace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxcel_plugin.link.tcp_chrono import TcpChrono

LINK, SENDER, RECEIVER = "link", "sender", "receiver"

# An ack saying the decode node's readers were busy (running or waiting for a CPU) for at
# least this share of their reading (link/read_load.py). Over a link slower than the
# receiver the readers sleep in recv and read far lower; where both are near their limit
# (10 Gbit/s into one busy core: 0.65-0.86, docs/benchmarks.md#bench_kv_plane) a floor at
# the link's rate is what the estimate gets, and raw bytes what the selector sends.
RECEIVER_PACED_SHARE = 0.8
# The busiest connection had data in flight for less than this share of the window: the
# link waited for bytes. Over a 40 Mbit/s link it is busy for 0.95-1.0 of a handoff's
# window; over 10 Gbit/s between namespaces, on a quiet machine, 0.72-0.78 for a 16 MB
# handoff that took 22-32 ms (near the link's own 13 ms: its pace, rightly); a few ms
# after a streamed prefill, 0-0.66 (jiffies) (tests/integration/netns/
# test_netns_rate_change.py).
LINK_BUSY_SHARE = 0.7
# The peer's receive window held them back for at least this share: the receiver's pace.
RWND_LIMITED_SHARE = 0.5


def pace_of(window_s: float, chrono: TcpChrono | None, reader_busy_share: float | None) -> str:
    """Who paced a window of ``window_s``: ``chrono`` is what the link's connections did in
    it, its busiest connection's (None: no kernel clock, so the time is the link's)."""
    if reader_busy_share is not None and reader_busy_share >= RECEIVER_PACED_SHARE:
        return RECEIVER
    if chrono is None or window_s <= 0:
        return LINK
    if chrono.rwnd_limited_s >= RWND_LIMITED_SHARE * window_s:
        return RECEIVER
    if chrono.busy_s < LINK_BUSY_SHARE * window_s:
        return SENDER
    return LINK


@dataclass(frozen=True)
class LinkSample:
    """A window to measure a link by: bytes, seconds, and what its busiest connection did
    meanwhile (None where there is no kernel clock)."""

    nbytes: int
    seconds: float
    chrono: TcpChrono | None = None

    def paced_by(self, reader_busy_share: float | None) -> str:
        """Who set its pace, given the ack's ``reader_busy_share``."""
        return pace_of(self.seconds, self.chrono, reader_busy_share)
