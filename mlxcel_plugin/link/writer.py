"""The send half of a link: a byte-bounded frame queue drained by one writer task.

``send`` waits while the queued bytes are spent (a slow peer makes senders
wait instead of growing memory). The writer task turns frames into link
records: small frames at the head of the queue share one BATCH record, big
bodies go to the bulk channel's thread after a BULK announcement, others are
split into PART/LAST records. A cancelled ``send`` never leaves half a record
on the wire: only the writer task writes. PONGs jump the queue.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from websockets.asyncio.connection import Connection
from websockets.exceptions import ConnectionClosed

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.bulk_lanes import BulkPipe
from mlxcel_plugin.link.protocol.frames import (
    BodyParts,
    Frame,
    FrameType,
    encode_frame,
    encode_header,
)
from mlxcel_plugin.link.protocol.handshake import Session
from mlxcel_plugin.link.protocol.record_reader import (
    BATCH_MIN_MINOR,
    BATCH_OVERHEAD_BYTES,
    batch_record,
    bulk_record,
    frame_record,
    part_records,
)
from mlxcel_plugin.link.send_budget import ByteBudget

logger = logging.getLogger("mlxcel_plugin.link")

_MAX_PENDING_CONTROL = 64  # PONGs waiting to go out; beyond this a ping flood is dropped

# (the exception, whether it is a protocol error rather than a lost connection)
FailureHandler = Callable[[BaseException, bool], None]


class LinkWriter:
    """Queues frames and writes them as records; ``run`` is the link's writer task."""

    def __init__(self, ws: Connection, session: Session, bulk: BulkPipe | None, *,
                 queue_bytes: int, max_record_bytes: int, bulk_threshold_bytes: int,
                 on_failure: FailureHandler, name: str):
        self._ws, self._session, self._bulk = ws, session, bulk
        self._max_record_bytes = max_record_bytes
        self._bulk_threshold_bytes = bulk_threshold_bytes
        self._on_failure, self._name = on_failure, name
        self._budget = ByteBudget(queue_bytes)
        self._outbox: collections.deque[tuple[Frame, int]] = collections.deque()
        self._outbox_ready = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._control: collections.deque[Frame] = collections.deque()
        self._bulk_writes = 0  # bodies handed to the bulk thread, not yet on the socket
        self._bulk_bodies = 0  # bodies for the bulk lanes queued or being written
        self._open = True

    @property
    def idle(self) -> bool:
        """Nothing queued: a frame queued now is the next one written."""
        return not self._outbox

    @property
    def queued_bytes(self) -> int:
        """Bytes of frames queued or being written, not yet handed to the sockets."""
        return self._budget.used

    async def put(self, frame: Frame, size: int) -> bool:
        """Queue a frame of ``size`` bytes once the budget has room, or at once where a bulk
        lane would otherwise idle (``_lane_idle_for``); False if closed meanwhile."""
        if self._lane_idle_for(frame):
            self._budget.take(size)
        else:
            await self._budget.acquire(size, lambda: self._open)
        if not self._open:
            self._budget.release(size)
            return False
        self._enqueue(frame, size)
        return True

    def try_put(self, frame: Frame, size: int) -> bool:
        """Queue a frame now if the budget has room (or a bulk lane would idle)."""
        if self._lane_idle_for(frame):
            self._budget.take(size)
        elif not self._budget.try_acquire(size):
            return False
        self._enqueue(frame, size)
        return True

    def put_control(self, frame: Frame) -> None:
        """A PONG: written before queued frames; dropped beyond a bound (a ping flood)."""
        if len(self._control) >= _MAX_PENDING_CONTROL:
            logger.debug("link %s: dropping PONG, %d already pending", self._name,
                         len(self._control))
            return
        self._control.append(frame)
        self._outbox_ready.set()

    async def drained(self) -> None:
        """Wait until every queued frame has been handed to the sockets (or the link closed)."""
        await self._drained.wait()

    def close(self) -> None:
        """Stop taking frames; wakes ``drained`` and any ``put`` waiting for room."""
        self._open = False
        self._drained.set()
        self._budget.wake_all()

    def _lane_idle_for(self, frame: Frame) -> bool:
        """Whether ``frame``'s body goes on a bulk lane while fewer bodies than lanes are queued
        or being written: it is queued whatever the budget holds.

        Why: a body's budget comes back once it is on the socket, and a KV frame carries up
        to 64 MiB against a 32 MiB budget, so the lanes took turns: one body at a time, the
        other lanes' threads idle, whatever the link's speed. At most ``lanes`` bodies pass
        this way, and a KV body is views of the sender's arrays, not a copy."""
        return (self._bulk is not None and self._on_bulk(frame)
                and self._bulk_bodies < self._bulk.lanes)

    def _enqueue(self, frame: Frame, size: int) -> None:
        if self._on_bulk(frame):
            self._bulk_bodies += 1
        self._outbox.append((frame, size))
        self._drained.clear()
        self._outbox_ready.set()

    async def run(self) -> None:
        try:
            while True:  # until the link closes
                if self._control:
                    await self._write_frame(self._control.popleft())
                    continue
                if not self._outbox:
                    if not self._bulk_writes:
                        self._drained.set()
                    self._outbox_ready.clear()
                    await self._outbox_ready.wait()
                    continue
                if self._batchable_at(0) and self._batchable_at(1):
                    await self._write_batch()
                    continue
                frame, size = self._outbox.popleft()
                in_flight = False
                try:
                    in_flight = await self._write_frame(frame, size)
                finally:
                    if not in_flight:
                        self._budget.release(size)
        except (ConnectionClosed, OSError) as exc:
            self._on_failure(exc, False)
        except ProtocolError as exc:
            self._on_failure(exc, True)

    def _batchable_at(self, index: int) -> bool:
        """Whether the queued frame at ``index`` may share a BATCH record with others."""
        if len(self._outbox) <= index or self._session.peer.minor < BATCH_MIN_MINOR:
            return False
        frame, size = self._outbox[index]
        small = size + BATCH_OVERHEAD_BYTES < self._max_record_bytes // 2
        return small and not self._on_bulk(frame)

    def _on_bulk(self, frame: Frame) -> bool:
        """Big bodies, and every KV chunk's, go on the bulk channel (unmasked, sealed in its
        thread, placed where the receiver wants them) where there is one.

        A KV begin's never does: the receiver places each chunk's body in the buffers the
        begin sets up, and a begin whose body (the prompt's tokens: 32 KiB at 8k tokens)
        were still being read off a lane would leave the first chunks without a place.
        """
        if self._bulk is None or not len(frame.body) or frame.type is FrameType.KV_BEGIN:
            return False
        return frame.type is FrameType.KV_CHUNK or len(frame.body) >= self._bulk_threshold_bytes

    async def _write_batch(self) -> None:
        """The small frames at the head of the queue, as one record (one seal, one write)."""
        encoded, queued_bytes, record_bytes = [], 0, 1
        limit = self._max_record_bytes
        while self._batchable_at(0) and (
                record_bytes + self._outbox[0][1] + BATCH_OVERHEAD_BYTES <= limit):
            frame, size = self._outbox.popleft()
            encoded.append(encode_frame(frame))
            queued_bytes += size
            record_bytes += size + BATCH_OVERHEAD_BYTES
        try:
            await self._send_record(batch_record(encoded))
        finally:
            self._budget.release(queued_bytes)

    async def _write_frame(self, frame: Frame, size: int = 0) -> bool:
        """Write one frame; True when its body is still going out on the bulk thread."""
        prefix = encode_header(frame.type, frame.header)
        body = frame.body
        if self._on_bulk(frame):
            lane = self._bulk.next_lane()
            # One-lane links announce as before lanes existed (peers without lanes read it).
            await self._send_record(bulk_record(len(body), prefix,
                                                lane if self._bulk.lanes > 1 else None))
            self._start_bulk_write(body, size, lane)
            return True
        limit = self._max_record_bytes - 1
        if len(prefix) + len(body) <= limit:
            await self._send_record(frame_record(prefix + bytes(body)))
            return False
        for record in part_records(prefix + bytes(body), limit):
            await self._send_record(record)
        return False

    def _start_bulk_write(self, body: bytes | bytearray | memoryview | BodyParts,
                          size: int, lane: int) -> None:
        """Hand the body to its lane's thread; its budget is released once it is on the socket."""
        future = self._bulk.write(body, lane)
        self._bulk_writes += 1

        def written(done: asyncio.Future) -> None:
            self._bulk_writes -= 1
            self._bulk_bodies -= 1
            self._budget.release(size)
            if done.cancelled():
                return
            if done.exception() is not None:
                self._on_failure(done.exception(), False)
            elif not self._bulk_writes and not self._outbox:
                self._drained.set()

        future.add_done_callback(written)

    async def _send_record(self, plaintext: bytes) -> None:
        # seal() reuses one buffer; websockets serializes it before send() returns.
        await self._ws.send(self._session.sender.seal(plaintext))
