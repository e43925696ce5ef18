"""A watchdog on a node's event loop: when it has not turned for a while, log where it is.

Why: a node whose loop stalls sends no telemetry and answers no PING, so the router
drops it after ``[health] ping_timeout_s`` (1.5 s), and the node's own log said nothing
of why (a suite once lost a request to a decode node silent for 2.2 s during its first
handoff). The loop schedules a heartbeat every ``interval_s``; a daemon thread that
finds the last one older than ``stall_s`` logs the loop thread's stack once, and how long
the stall lasted when the loop turns again. Its cost: one timer callback per interval on
the loop and one wakeup of the thread.

A stall inside C code that holds the GIL is reported only once the GIL is free again,
with the stack of wherever the loop is by then; one in Python code or in a call that
releases the GIL (I/O, MLX, AES) shows the stalled frame.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

from mlxcel_plugin.libc import name_os_thread

logger = logging.getLogger(__name__)

STALL_S = 1.0  # below the router's 1.5 s ping timeout: the log says why before it drops us
INTERVAL_S = 0.1
STACK_FRAMES = 10


class LoopWatchdog:
    def __init__(self, loop: asyncio.AbstractEventLoop, stall_s: float = STALL_S,
                 interval_s: float = INTERVAL_S):
        self.loop, self.stall_s, self.interval_s = loop, stall_s, interval_s
        self.stalls = 0  # reported so far (tests, stats)
        self._beat_s = time.monotonic()
        self._loop_thread: int | None = None  # set by start(), on the loop's thread
        self._stop = threading.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._watch, name="mlxcel-loop-watchdog",
                                        daemon=True)

    def start(self) -> LoopWatchdog:
        """Call on the loop's own thread."""
        self._loop_thread = threading.get_ident()
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        self._thread.join(timeout=1.0)

    def _beat(self) -> None:
        self._beat_s = time.monotonic()
        self._timer = self.loop.call_later(self.interval_s, self._beat)

    def _watch(self) -> None:
        name_os_thread()
        stalled_since: float | None = None
        while not self._stop.wait(self.interval_s):  # until stop()
            beat_s, now = self._beat_s, time.monotonic()
            if now - beat_s > self.stall_s and stalled_since != beat_s:
                stalled_since = beat_s
                self.stalls += 1
                logger.warning("event loop has not turned for %.1f s; it is in:\n%s",
                               now - beat_s, self._loop_stack())
            elif stalled_since is not None and beat_s != stalled_since:
                logger.warning("event loop turned again after a %.1f s stall",
                               beat_s - stalled_since)
                stalled_since = None

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "  (the loop's thread has no frame)"
        frames = traceback.extract_stack(frame)[-STACK_FRAMES:]  # one short line each
        return "\n".join(f"  {f.filename}:{f.lineno} in {f.name}" for f in frames)
