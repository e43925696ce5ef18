"""The bulk channel: a raw TCP stream beside a link's WebSocket, for large bodies.

Why: on loopback a WebSocket message path tops out near a quarter of raw TCP
(receive-side copying in websockets, docs/design.md). The bulk channel carries only
frame bodies, as AES-256-GCM records with their own keys and sequence numbers
from the same handshake; the frame's header and the body length go over the
WebSocket (authenticated), so ordering and lengths come from the control link
and the stream itself needs no framing. I/O is blocking ``sendall`` /
``recv_into(MSG_WAITALL)`` into preallocated buffers, in a worker thread: one
syscall per record, no event-loop round trips, no per-record allocation. A lane seals
and sends in the same thread: the kernel's autotuned send buffer already overlaps
the wire with the sealing of the next record (docs/bulk-lanes.md#one-thread-per-direction).

Attaching: the server's ACCEPT verdict (encrypted) names a port and a one-time
token; the client connects and sends ``MLXB ‖ token ‖ HMAC(k_auth, "bulk client"
‖ token ‖ H(transcript))``, the server answers ``MLXB ‖ HMAC(k_auth, "bulk
server" ‖ ...)``. Only the two ends of that handshake can produce either MAC.
"""

from __future__ import annotations

import logging
import socket
import struct
import sys
from collections.abc import Iterator, Sequence

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.protocol.body_parts import BodyParts
from mlxcel_plugin.link.protocol.checksum import crc32
from mlxcel_plugin.link.protocol.handshake import Session
from mlxcel_plugin.link.protocol.records import TAG_BYTES, RecordReceiver, RecordSender
from mlxcel_plugin.link.read_load import ReadLoad, ReadTimer
from mlxcel_plugin.link.tcp_chrono import TcpChrono, tcp_chrono

logger = logging.getLogger("mlxcel_plugin.link")

BULK_MAGIC = b"MLXB"
TOKEN_BYTES = 16
MAC_BYTES = 32
CLIENT_HELLO_BYTES = len(BULK_MAGIC) + TOKEN_BYTES + MAC_BYTES
SERVER_HELLO_BYTES = len(BULK_MAGIC) + MAC_BYTES
DEFAULT_CHUNK_BYTES = 1024 * 1024
# What benchmarks' raw-TCP baselines pinned their buffers to (the bulk channel autotunes).
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
# Thread name prefixes of the bulk channel's I/O threads (benchmarks attribute CPU by them).
BULK_OUT_THREAD = "mlxcel-bulk-out"
BULK_IN_THREAD = "mlxcel-bulk-in"


class BulkError(ProtocolError):
    code = "bulk_channel"


class BulkAuthError(BulkError):
    code = "bulk_auth_failed"


class BulkTimeout(BulkError):
    code = "bulk_timeout"


# ---------------------------------------------------------------- data path


def _set_io_timeout(sock: socket.socket, timeout_s: float) -> None:
    """Blocking socket with kernel timeouts, so MSG_WAITALL works and a stall ends."""
    sock.settimeout(None)
    whole = max(1, int(timeout_s))
    tv = struct.pack("ll", whole, 0) if sys.platform != "darwin" else struct.pack("qi4x", whole, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _tune(sock: socket.socket) -> None:
    # SO_SNDBUF/SO_RCVBUF stay unset: pinning them turns off Linux's autotuning, which
    # grows a socket's buffers past rmem_max/wmem_max to what a fast, distant link needs.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _announce_landed(parts: BodyParts, pieces: list[tuple[int, memoryview]],
                     left: list[int]) -> None:
    """Tell ``parts.landed`` of each part whose last byte this (authenticated) record held."""
    for index, piece in pieces:
        left[index] -= len(piece)
        if not left[index]:
            parts.landed(index)


def _views(body: bytes | bytearray | memoryview | BodyParts) -> tuple[memoryview, ...]:
    if isinstance(body, BodyParts):
        return body.views
    return (memoryview(body).cast("B"),)


def record_spans(views: Sequence[memoryview],
                 record_bytes: int) -> Iterator[list[tuple[int, memoryview]]]:
    """(part index, piece) for each piece of ``views`` (back to back) in each record.

    Both ends cut a body the same way, so a record boundary needs no framing.
    """
    pieces: list[tuple[int, memoryview]] = []
    room = record_bytes
    for index, view in enumerate(views):
        at = 0
        while at < len(view):  # bounded: each pass consumes >= 1 byte of view
            take = min(room, len(view) - at)
            pieces.append((index, view[at:at + take]))
            at, room = at + take, room - take
            if not room:
                yield pieces
                pieces, room = [], record_bytes
    if pieces:
        yield pieces


class BulkChannel:
    """One authenticated bulk stream (a lane); ``write_body``/``read_body`` block (run them
    in a thread).

    Each direction is used by one thread at a time (the link's writer task and
    reader task each await their side), so no locking is needed here.
    """

    def __init__(self, sock: socket.socket, sender: RecordSender, receiver: RecordReceiver,
                 chunk_bytes: int, io_timeout_s: float):
        self._sock = sock
        self._sender, self._receiver = sender, receiver
        self.chunk_bytes = chunk_bytes
        self._out = bytearray(chunk_bytes + TAG_BYTES)
        self._in = bytearray(chunk_bytes + TAG_BYTES)
        self._plain: bytearray | None = None  # for bodies without a sink buffer, on first use
        self.read_load = ReadLoad()  # every body read so far (link/read_load.py)
        _tune(sock)
        _set_io_timeout(sock, io_timeout_s)

    def write_body(self, body: bytes | bytearray | memoryview | BodyParts) -> None:
        """Send a body as records of ``chunk_bytes``; a BodyParts' records span its parts."""
        out = memoryview(self._out)
        try:
            for pieces in record_spans(_views(body), self.chunk_bytes):
                n = self._sender.seal_parts_into([piece for _, piece in pieces], out)
                self._sock.sendall(out[:n])
        except TimeoutError as exc:
            raise BulkTimeout("bulk channel send timed out") from exc

    def read_body(self, n_bytes: int, into: memoryview | BodyParts | None = None
                  ) -> bytearray | memoryview | BodyParts:
        """``_read_body``, adding how busy this reader was to ``read_load`` (only this
        lane's reader thread writes it; one attribute store, so readers elsewhere see
        a whole figure)."""
        with ReadTimer() as timer:
            body = self._read_body(n_bytes, into)
        self.read_load = self.read_load + timer.load
        return body

    def _read_body(self, n_bytes: int, into: memoryview | BodyParts | None
                   ) -> bytearray | memoryview | BodyParts:
        """Read exactly ``n_bytes`` of body (the length came authenticated over the link).

        ``into`` (writable buffers of ``n_bytes`` in all: one, or a BodyParts
        to scatter into) receives the plaintext and is returned; otherwise a
        fresh buffer does, grown as records arrive. A BodyParts asking for ``checksums`` gets each
        part's crc32, taken right after each record's bytes are decrypted. A
        record that fails authentication raises, and the link fails with it.
        """
        if into is None:
            return self._read_as_it_arrives(n_bytes)
        body = into
        views = _views(body)
        parts = body if isinstance(body, BodyParts) else None
        crcs = [0] * len(views) if parts is not None and parts.checksums else None
        left = [len(v) for v in views] if parts is not None and parts.landed else None
        for pieces in record_spans(views, self.chunk_bytes):
            dests = [piece for _, piece in pieces]
            record = self._recv_exactly(sum(len(d) for d in dests) + TAG_BYTES)
            self._receiver.open_parts_into(record, dests)
            if crcs is not None:  # just written: still in cache
                for index, piece in pieces:
                    crcs[index] = crc32(piece, crcs[index])
            if left is not None:
                _announce_landed(parts, pieces, left)
        if crcs is not None:
            body.crcs = crcs
        return body

    def _read_as_it_arrives(self, n_bytes: int) -> bytearray:
        """A body with no sink buffer: memory grows one authenticated record at a time.

        Why: the length is the peer's claim; allocating it up front let two ~60-byte
        BULK records from an authenticated peer take 512 MiB before any byte came.
        """
        body = bytearray()
        if self._plain is None:
            self._plain = bytearray(self.chunk_bytes)
        plain = memoryview(self._plain)
        while len(body) < n_bytes:  # each pass adds one record's bytes or raises
            take = min(self.chunk_bytes, n_bytes - len(body))
            self._receiver.open_into(self._recv_exactly(take + TAG_BYTES), plain[:take])
            body += plain[:take]
        return body

    def _recv_exactly(self, size: int) -> memoryview:
        view = memoryview(self._in)[:size]
        got = 0
        while got < size:  # bounded: each pass reads >= 1 byte or raises
            try:
                n = self._sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError) as exc:
                raise BulkTimeout("bulk channel receive timed out") from exc
            if n == 0:
                raise BulkError("bulk channel closed in the middle of a body")
            got += n
        return view

    def tcp_chrono(self) -> TcpChrono | None:
        """The lane's connection's time with data in flight (link/tcp_chrono.py)."""
        return tcp_chrono(self._sock)

    def shutdown(self) -> None:
        """Wake threads blocked in send/recv on this socket (they then fail fast)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            logger.debug("bulk socket already disconnected")

    def close(self) -> None:
        """Release the socket; call once no thread uses it any more."""
        self.shutdown()
        self._sock.close()


def make_channel(sock: socket.socket, session: Session, chunk_bytes: int,
                 io_timeout_s: float, lane: int = 0) -> BulkChannel:
    """Bulk lane ``lane`` of ``session`` over ``sock`` (each lane has its own keys)."""
    sender, receiver = session.bulk_records(max_record_bytes=chunk_bytes, lane=lane)
    return BulkChannel(sock, sender, receiver, chunk_bytes, io_timeout_s)
