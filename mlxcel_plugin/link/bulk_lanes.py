"""A link's bulk lanes driven from its event loop: per lane, one thread per direction.

Why lanes: one TCP stream with one thread sealing and sending tops out at what
that thread does per byte (AEAD, the kernel's copy); a handoff's bodies spread
over N lanes (each its own socket, keys and threads) seal, send, receive and
open in parallel. The link's writer picks each body's lane (round-robin) and
names it, authenticated, in the BULK record that announces the body, so the
receiver reads that body from that lane; frames are still handed over in
announcement order (``delivery``), whatever lane their body came on.

Bodies on one lane are written and read strictly in submission order, so the
link's writer and reader tasks can queue the next body without waiting for the
last. The event loop only schedules: every KV byte is sealed, sent, received and
opened in a lane thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from mlxcel_plugin.libc import name_os_thread
from mlxcel_plugin.link.bulk import BULK_IN_THREAD, BULK_OUT_THREAD, BulkChannel
from mlxcel_plugin.link.protocol.body_parts import BodyParts
from mlxcel_plugin.link.protocol.frames import Frame
from mlxcel_plugin.link.protocol.record_reader import BulkBody
from mlxcel_plugin.link.read_load import ReadLoad
from mlxcel_plugin.link.tcp_chrono import Counts

Received = bytearray | memoryview | BodyParts

logger = logging.getLogger("mlxcel_plugin.link")


class BulkPipe:
    """The bulk lanes of one link; ``write``/``read`` return futures on the running loop."""

    def __init__(self, channels: Sequence[BulkChannel], reader_nice: int = 0):
        if not channels:
            raise ValueError("a bulk pipe needs at least one lane")
        self.channels = tuple(channels)
        self._out = [ThreadPoolExecutor(1, f"{BULK_OUT_THREAD}{lane}", initializer=name_os_thread)
                     for lane in range(len(channels))]
        self._in = [ThreadPoolExecutor(1, f"{BULK_IN_THREAD}{lane}",
                                       initializer=_start_reader, initargs=(reader_nice,))
                    for lane in range(len(channels))]
        self._next_lane = 0
        # Done once the last read queued has ended; holds none of its body (``read_frame``).
        self._last_read: asyncio.Future[None] | None = None

    @property
    def lanes(self) -> int:
        return len(self.channels)

    @property
    def channel(self) -> BulkChannel:
        """Lane 0 (the only one on a one-lane link)."""
        return self.channels[0]

    def read_load(self) -> ReadLoad:
        """How busy the lanes' readers were over every body read so far (``read_load``)."""
        return sum((channel.read_load for channel in self.channels), ReadLoad())

    def tcp_chronos(self) -> Counts:
        """Each lane's connection's time with data in flight (link/tcp_chrono.py)."""
        return tuple(channel.tcp_chrono() for channel in self.channels)

    def next_lane(self) -> int:
        """The lane for the next body: round-robin, so consecutive bodies go out in parallel."""
        lane = self._next_lane
        self._next_lane = (lane + 1) % len(self.channels)
        return lane

    def write(self, body: bytes | bytearray | memoryview | BodyParts,
              lane: int = 0) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._out[lane], self.channels[lane].write_body, body)

    def read(self, n_bytes: int, into: memoryview | BodyParts | None, lane: int = 0
             ) -> asyncio.Future[bytearray | memoryview | BodyParts]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._in[lane], self.channels[lane].read_body, n_bytes, into)

    def read_frame(self, bulk: BulkBody, into: memoryview | BodyParts | None,
                   make_frame: Callable[[BulkBody, Received], Frame | None],
                   fail: Callable[[BaseException], None]) -> asyncio.Future[Frame | None]:
        """Read an announced body on its lane; the future gives its frame (None when the
        read failed, after ``fail`` was told, or was cancelled)."""
        body_read = self.read(bulk.n_bytes, into, bulk.lane)
        loop = asyncio.get_running_loop()
        frame: asyncio.Future[Frame | None] = loop.create_future()
        self._last_read = read_over = loop.create_future()

        def arrived(done: asyncio.Future) -> None:
            read_over.set_result(None)
            if frame.done():
                return
            if done.cancelled():
                frame.set_result(None)
            elif done.exception() is not None:
                # recv() skips the None and then meets the close the failure queues.
                frame.set_result(None)
                fail(done.exception())
            else:
                frame.set_result(make_frame(bulk, done.result()))

        body_read.add_done_callback(arrived)
        return frame

    async def reads_done(self, timeout_s: float) -> None:
        """Wait, up to ``timeout_s``, for every read queued so far to end.

        Why not keep the last frame's future for this: its result is the frame, whose body
        is views of the receiver's buffers; held until the next body, a decode node's last
        frame of each handoff left its K/V shared, and MLX copied them at the first decode
        step instead of writing the token in place."""
        if self._last_read is not None:
            await asyncio.wait({self._last_read}, timeout=timeout_s)

    async def stop(self) -> None:
        """Fail queued and running transfers on every lane, then release the sockets."""
        for channel in self.channels:
            channel.shutdown()  # wakes worker threads blocked on the socket
        for executor in (*self._out, *self._in):
            executor.shutdown(wait=False, cancel_futures=True)
        # Close the fds only after the threads let go of them, so none is reused under them.
        await asyncio.to_thread(self._join)
        for channel in self.channels:
            channel.close()

    def _join(self) -> None:
        for executor in (*self._out, *self._in):
            executor.shutdown(wait=True)


def _start_reader(nice: int) -> None:
    """Name the calling reader thread for the OS and renice it (Linux schedules threads as
    tasks; elsewhere a no-op)."""
    name_os_thread()
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        logger.debug("cannot renice the bulk reader thread: %s", exc)
