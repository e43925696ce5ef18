"""A link: one authenticated, encrypted, bidirectional frame stream between two nodes.

The control path is a WebSocket (websockets 15, ``compression=None``): every
message after the handshake is one AES-GCM record carrying one link record, whose
kinds (a frame, several, a piece of one, a bulk body's announcement) are in
``protocol/record_reader`` and docs/protocol.md §3.
Large bodies go over the bulk channel (``bulk``) when both ends have one,
otherwise they are split into PART/LAST records no bigger than the record bound.
A consumer may register a body sink (``set_body_sink``, see ``bodies``) that
names, per announced bulk frame, the buffer its body should be decrypted into —
the KV receiver points it at the layer buffer, so a body is written once.
Sends go through ``writer``'s byte-bounded queue (a slow peer makes ``send`` wait).
One reader task decrypts, answers PINGs, and hands frames to ``recv`` (bounded).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from websockets.asyncio.connection import Connection
from websockets.exceptions import ConnectionClosed

from mlxcel_plugin.errors import NodeLostError, ProtocolError
from mlxcel_plugin.link.bodies import BodySink, flat_body, sink_buffer
from mlxcel_plugin.link.bulk import BulkChannel
from mlxcel_plugin.link.bulk_lanes import BulkPipe
from mlxcel_plugin.link.config import (
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    CLOSE_TRY_AGAIN_LATER,
    LinkConfig,
)
from mlxcel_plugin.link.delivery import FrameDelivery
from mlxcel_plugin.link.protocol.frames import BodyParts, Frame, FrameType, Ping, frame_size
from mlxcel_plugin.link.protocol.handshake import PeerInfo, Session
from mlxcel_plugin.link.protocol.record_reader import BulkBody, FrameTooLarge, RecordReader
from mlxcel_plugin.link.read_load import ReadLoad
from mlxcel_plugin.link.tcp_chrono import Counts, tcp_chrono
from mlxcel_plugin.link.writer import LinkWriter

# Re-exported: the link's config, close codes and body sink lived here before their modules.
__all__ = [
    "CLOSE_GOING_AWAY",
    "CLOSE_INTERNAL_ERROR",
    "CLOSE_NORMAL",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_TRY_AGAIN_LATER",
    "BodySink",
    "Link",
    "LinkClosed",
    "LinkConfig",
]

logger = logging.getLogger("mlxcel_plugin.link")


class LinkClosed(NodeLostError):
    """The link is closed (by either side, or after a protocol failure)."""

    code = "link_closed"


_CLOSED = object()


class Link:
    """An established link; made by ``dial_link`` or handed to ``serve_links``' ``on_link``."""

    def __init__(self, ws: Connection, session: Session, config: LinkConfig,
                 bulk: BulkChannel | Sequence[BulkChannel] | None = None, *,
                 local_role: str = "", local_node_id: str = "",
                 peer_announce: Mapping[str, str] | None = None):
        self._ws, self._session, self._config = ws, session, config
        # What the accepting peer announced in its verdict (a node: its "model").
        self.peer_announce: Mapping[str, str] = dict(peer_announce or {})
        lanes = [bulk] if isinstance(bulk, BulkChannel) else list(bulk or ())
        self._bulk = BulkPipe(lanes, config.bulk_reader_nice) if lanes else None
        self.local_role, self.local_node_id = local_role, local_node_id
        self.remote_address = _format_address(ws.remote_address)
        self.error: ProtocolError | None = None
        self._closed = False
        self._writer = LinkWriter(
            ws, session, self._bulk, queue_bytes=config.send_queue_bytes,
            max_record_bytes=config.max_record_bytes,
            bulk_threshold_bytes=config.bulk_threshold_bytes,
            on_failure=self._writer_failed, name=local_node_id)
        self._inbox: asyncio.Queue[object] = asyncio.Queue(config.recv_queue_frames)
        self._records = RecordReader(config.max_frame_bytes, bulk=bool(lanes),
                                     name=local_node_id, lanes=max(1, len(lanes)))
        self._head: object | None = None
        self._body_sink: BodySink | None = None
        self._delivery: FrameDelivery | None = None  # set by deliver_to
        self._done = asyncio.Event()
        self._closer: asyncio.Task[None] | None = None
        self._tasks = [asyncio.create_task(self._writer.run(), name="link-writer"),
                       asyncio.create_task(self._read_loop(), name="link-reader")]

    # ------------------------------------------------------------ public API

    @property
    def peer(self) -> PeerInfo:
        return self._session.peer

    @property
    def peer_role(self) -> str:
        return self._session.peer.role

    @property
    def peer_node_id(self) -> str:
        return self._session.peer.node_id

    @property
    def has_bulk(self) -> bool:
        return self._bulk is not None

    @property
    def bulk_lanes(self) -> int:
        """Bulk lanes (parallel TCP streams for bodies) this link has: 0 without a channel."""
        return self._bulk.lanes if self._bulk is not None else 0

    def bulk_read_load(self) -> ReadLoad:
        """How busy its bulk readers were over the bodies they read (link/read_load.py)."""
        return self._bulk.read_load() if self._bulk is not None else ReadLoad()

    def body_tcp_chronos(self) -> Counts:
        """Kernel clocks of the connections carrying its bodies (link/tcp_chrono.py)."""
        if self._bulk is not None:
            return self._bulk.tcp_chronos()
        return (tcp_chrono(self._ws.transport.get_extra_info("socket")),)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def latency_s(self) -> float:
        """Round trip of the last WebSocket keepalive ping (0 before the first)."""
        return self._ws.latency

    def __repr__(self) -> str:
        return (f"Link(peer={self.peer_node_id!r}, role={self.peer_role!r}, "
                f"address={self.remote_address!r}, closed={self._closed})")

    def set_body_sink(self, sink: BodySink | None) -> None:
        """Have bulk bodies decrypted into buffers ``sink`` provides (None: fresh buffers).

        The frame ``recv`` returns then carries the sink's buffer as its body.
        Only bodies that take the bulk channel are offered; small ones arrive
        in their record as before.
        """
        self._body_sink = sink

    def deliver_to(self, handler: Callable[[Frame], None]) -> None:
        """Hand every later frame to ``handler`` on the reader task instead of ``recv``.

        One task hop less per frame, and a frame is handled before the next
        record is read (so a body sink already sees what that frame set up).
        Frames keep their order: frames that arrived before this call go first,
        and a frame whose body is still on the bulk channel holds back the
        frames behind it, while later records are still read and their bodies
        queued back to back. A ProtocolError raised by the handler closes the
        link with 1008, like a malformed record; any other exception with 1011.
        """
        delivery = FrameDelivery(handler, self._start_bulk_read, self._handler_failed,
                                 f"{self.local_node_id} from {self.peer_node_id}")
        while not self._inbox.empty():  # bounded by the queue's length
            item = self._inbox.get_nowait()
            if item is _CLOSED:
                break
            delivery.put(item)
        self._delivery = delivery
        delivery.advance()

    async def send(self, frame: Frame) -> None:
        """Queue one frame; waits while the send queue is full. Raises LinkClosed.

        The body may be any C-contiguous buffer (bytes, memoryview, numpy array), or a
        BodyParts of them; it is sent without a copy (on the bulk channel), so do not
        modify it until ``drain()`` returns."""
        frame, size = self._checked(frame)
        if not await self._writer.put(frame, size):
            self._raise_if_closed()

    def try_send(self, frame: Frame) -> bool:
        """Queue one frame now if the send queue has room (else False; raises LinkClosed);
        from sync code. Frames keep their order with ``send``'s."""
        frame, size = self._checked(frame)
        return self._writer.try_put(frame, size)

    @property
    def idle(self) -> bool:
        """Nothing queued: a frame sent now is the next one written."""
        return self._writer.idle

    @property
    def queued_bytes(self) -> int:
        """Bytes this link has taken and not yet handed to its sockets."""
        return self._writer.queued_bytes

    def _checked(self, frame: Frame) -> tuple[Frame, int]:
        frame = flat_body(frame)
        size = frame_size(frame)
        if size > self._config.max_frame_bytes:
            raise FrameTooLarge(f"frame of {size} bytes exceeds {self._config.max_frame_bytes}")
        self._raise_if_closed()
        return frame, size

    async def recv(self) -> Frame:
        """The next frame from the peer; raises LinkClosed once the link is closed. Safe to
        cancel: a frame being awaited stays first in line for the next call."""
        while True:  # skips bulk frames of unknown type; ends with a frame or LinkClosed
            if self._head is None:
                if self._closed and self._inbox.empty():
                    self._raise_if_closed()
                self._head = await self._inbox.get()
            item = self._head
            if item is _CLOSED:
                self._raise_if_closed()
            if isinstance(item, asyncio.Future):
                # shield: if our caller is cancelled, the body keeps coming for the next recv.
                item = await asyncio.shield(item)
            self._head = None
            if item is not None:
                return item

    async def __aiter__(self) -> AsyncIterator[Frame]:
        """Frames until the link closes (check ``error`` for why)."""
        while True:  # ends when the link closes
            try:
                yield await self.recv()
            except LinkClosed:
                return

    async def drain(self) -> None:
        """Wait until every queued frame has been handed to the sockets."""
        await self._writer.drained()
        self._raise_if_closed()

    async def close(self, code: int = CLOSE_NORMAL, reason: str = "", *,
                    flush: bool = True) -> None:
        """Close both channels; idempotent.

        With ``flush`` queued frames still go out first, for at most
        ``close_timeout_s``; after a failure nothing more is sent.
        """
        if self._closed:
            await self._done.wait()
            return
        if flush and self.error is None:
            await self._flush_quietly()
        await self._shut_down()
        # The close handshake (bounded by close_timeout_s) runs after wait_closed() returns:
        # nobody waiting for the link to go waits on a peer that may never answer.
        await self._ws.close(code, reason)

    async def abort(self) -> None:
        """Drop the link at once: nothing more sent, no close handshake; idempotent.

        For a peer that stopped answering (a hung or SIGSTOPped process): a close
        handshake would wait ``close_timeout_s`` for it.
        """
        if self._closed:
            await self._done.wait()
            return
        self._ws.transport.abort()
        await self._shut_down()

    async def _shut_down(self) -> None:
        self._mark_closed()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not current),
                             return_exceptions=True)
        if self._bulk is not None:
            await self._bulk.stop()
        self._done.set()

    async def wait_closed(self) -> None:
        await self._done.wait()

    async def _flush_quietly(self) -> None:
        try:
            async with asyncio.timeout(self._config.close_timeout_s):
                await self._writer.drained()
        except TimeoutError:
            logger.info("link %s: closing with frames unsent to %s after %.1fs",
                        self.local_node_id, self.peer_node_id, self._config.close_timeout_s)

    # ------------------------------------------------------------ internals

    def _raise_if_closed(self) -> None:
        if self._closed:
            reason = self.error.message if self.error else "closed"
            raise LinkClosed(f"link to {self.peer_node_id} is closed: {reason}")

    def _mark_closed(self) -> None:
        self._closed = True
        self._writer.close()
        if not self._inbox.full():
            self._inbox.put_nowait(_CLOSED)  # wakes a recv() blocked on an empty inbox
        # else: frames already received stay deliverable; recv() sees the close after them

    def _spawn_fail(self, args: tuple[BaseException, int]) -> None:
        # A separate task: close() cancels the reader and writer, which may be the caller.
        if self._closer is None:
            self._closer = asyncio.create_task(self._fail(*args), name="link-close")

    async def _fail(self, exc: BaseException, code: int) -> None:
        """Log a failure naming the peer (never keys or the secret) and close."""
        if isinstance(exc, ProtocolError):
            self.error = exc
            logger.warning("link %s: protocol failure from %s (%s %s): %s; closing",
                           self.local_node_id, self.remote_address, self.peer_role,
                           self.peer_node_id, exc.message)
            reason = exc.code or "protocol_error"
        else:
            logger.info("link %s: connection to %s (%s) lost: %s", self.local_node_id,
                        self.remote_address, self.peer_node_id, type(exc).__name__)
            reason = ""
        await self.close(code, reason[:120], flush=False)

    def _writer_failed(self, exc: BaseException, protocol: bool) -> None:
        self._spawn_fail((exc, CLOSE_POLICY_VIOLATION if protocol else CLOSE_GOING_AWAY))

    # reader

    async def _read_loop(self) -> None:
        try:
            while True:  # until the peer closes or breaks the protocol
                message = await self._ws.recv()
                for item in await self._handle_message(message):
                    await self._hand_over(item)
                # Buffered messages would otherwise all be handled before another link's
                # first: a LayerParallel lane waited ~6 ms for the loop while its peer sent.
                await asyncio.sleep(0)
        except ConnectionClosed as exc:
            # Bodies announced before the close are still arriving on the bulk channel.
            await self._finish_bulk_reads()
            self._spawn_fail((exc, CLOSE_NORMAL))
        except ProtocolError as exc:
            self._spawn_fail((exc, CLOSE_POLICY_VIOLATION))
        except OSError as exc:
            self._spawn_fail((exc, CLOSE_GOING_AWAY))

    async def _hand_over(self, item: Frame | BulkBody) -> None:
        if self._delivery is not None:
            self._delivery.put(item)
            return
        # recv(): a body is read at once, its frame awaited in order.
        await self._inbox.put(self._start_bulk_read(item) if isinstance(item, BulkBody) else item)

    def _handler_failed(self, exc: BaseException) -> None:
        code = CLOSE_POLICY_VIOLATION if isinstance(exc, ProtocolError) else CLOSE_INTERNAL_ERROR
        self._spawn_fail((exc, code))

    async def _finish_bulk_reads(self) -> None:
        if self._bulk is not None:
            await self._bulk.reads_done(self._config.close_timeout_s)

    async def _handle_message(self, message: bytes | str) -> list[Frame | BulkBody]:
        """What one record brings for the app, in order (PINGs and unknown types dropped)."""
        if not isinstance(message, bytes):
            raise ProtocolError("text message on a link; only binary records are allowed")
        items: list[Frame | BulkBody] = []
        for item in self._records.feed(self._session.receiver.open(message)):
            if isinstance(item, BulkBody) or (item := self._deliver(item)) is not None:
                items.append(item)
        return items

    def _start_bulk_read(self, bulk: BulkBody) -> asyncio.Future:
        """Queue the body read on its lane; recv() or the delivery awaits the frame in order."""
        # Read the body even for an unknown frame type, to keep the stream in step.
        return self._bulk.read_frame(
            bulk, self._sink_buffer(bulk), self._records.bulk_frame,
            lambda exc: self._spawn_fail((exc, CLOSE_POLICY_VIOLATION)))

    def _sink_buffer(self, bulk: BulkBody) -> memoryview | BodyParts | None:
        return sink_buffer(self._body_sink, bulk, self.local_node_id)

    def _deliver(self, frame: Frame) -> Frame | None:
        """PINGs are answered here (whether or not the app is reading); the rest go to recv."""
        if frame.type is FrameType.PING:
            self._writer.put_control(Ping.from_frame(frame).pong())
            return None
        return frame


def _format_address(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address)
