"""How busy a bulk lane's reader was while it read bodies: whether the receiver set the pace.

Why: a prefill node learns a link's bandwidth from how long its handoffs take. When the
decode node, not the link, set that pace (its readers starved of CPU by the streams it
decodes at a low ``ingest_nice``, or slowed by a codec's decoding), the figure says
nothing of the link, and a codec chosen on it would only add to the receiver's work
(docs/bulk-lanes.md#who-set-the-pace). A reader that spent most of a body's read running or
waiting for a CPU set the pace; one that slept in ``recv`` waited for the link.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

# Linux: the calling thread's time on a CPU and time runnable but waiting for one (ns).
_SCHEDSTAT = Path("/proc/thread-self/schedstat")
_HAS_SCHEDSTAT = _SCHEDSTAT.exists()


def thread_busy_s() -> float:
    """The calling thread's CPU seconds, plus (Linux) its seconds waiting on a run queue."""
    if _HAS_SCHEDSTAT:
        try:
            on_cpu_ns, waiting_ns, _ = _SCHEDSTAT.read_bytes().split()
            return (int(on_cpu_ns) + int(waiting_ns)) / 1e9
        except (OSError, ValueError):
            pass
    return time.thread_time()


@dataclass(frozen=True)
class ReadLoad:
    """Seconds readers were busy (running or runnable) over seconds they spent reading bodies."""

    busy_s: float = 0.0
    wall_s: float = 0.0

    def __add__(self, other: ReadLoad) -> ReadLoad:
        return ReadLoad(self.busy_s + other.busy_s, self.wall_s + other.wall_s)

    def __sub__(self, other: ReadLoad) -> ReadLoad:
        return ReadLoad(self.busy_s - other.busy_s, self.wall_s - other.wall_s)

    @property
    def busy_share(self) -> float | None:
        """Busy over reading time, 0..1; None before any body was read."""
        if self.wall_s <= 0:
            return None
        return min(1.0, max(0.0, self.busy_s / self.wall_s))


class ReadTimer:
    """Times one body read on the reader's thread: ``with ReadTimer() as t: ...; t.load``."""

    def __enter__(self) -> ReadTimer:
        self._wall, self._busy = time.perf_counter(), thread_busy_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self.load = ReadLoad(thread_busy_s() - self._busy, time.perf_counter() - self._wall)
