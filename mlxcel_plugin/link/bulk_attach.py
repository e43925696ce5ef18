"""Attaching a bulk channel to a link: the client's proof and the server's listener.

The protocol is described in ``mlxcel_plugin/link/bulk.py``; this module is its
handshake half (one-time token, MACs over the link's transcript).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
from dataclasses import dataclass

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.bulk import (
    BULK_MAGIC,
    CLIENT_HELLO_BYTES,
    SERVER_HELLO_BYTES,
    TOKEN_BYTES,
    BulkAuthError,
    BulkChannel,
    BulkError,
    make_channel,
)
from mlxcel_plugin.link.protocol.handshake import Session
from mlxcel_plugin.link.refusal_log import RefusalLog


async def _recv_exactly_async(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                              size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:  # bounded by size; each pass reads >= 1 byte or fails
        chunk = await loop.sock_recv(sock, size - len(buf))
        if not chunk:
            raise BulkError("bulk channel closed during its hello")
        buf += chunk
    return bytes(buf)


class BulkLanesRefused(BulkError):
    """The peer granted more bulk lanes than this end asked for (its budget)."""

    code = "bulk_lanes_refused"


def lane_label(side: bytes, lane: int) -> bytes:
    """The MAC label of a lane's hello: lane 0 keeps the one-lane channel's label."""
    return side if lane == 0 else side + b" lane %d" % lane


async def attach_client(host: str, port: int, token: bytes, session: Session,
                        chunk_bytes: int, io_timeout_s: float, lane: int = 0) -> BulkChannel:
    """Client side: connect lane ``lane`` to the announced bulk port and prove the session."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, address)
        hello = BULK_MAGIC + token + session.channel_mac(lane_label(b"bulk client", lane), token)
        await loop.sock_sendall(sock, hello)
        reply = await _recv_exactly_async(loop, sock, SERVER_HELLO_BYTES)
        expected = BULK_MAGIC + session.channel_mac(lane_label(b"bulk server", lane), token)
        if not hmac.compare_digest(reply, expected):
            raise BulkAuthError("bulk channel server MAC does not verify")
        return make_channel(sock, session, chunk_bytes, io_timeout_s, lane)
    except BaseException:
        sock.close()
        raise


@dataclass
class _Pending:
    session: Session
    future: asyncio.Future[socket.socket]
    lane: int = 0


class BulkListener:
    """Server side: one listening socket shared by every link of a ``serve_links``."""

    def __init__(self, sock: socket.socket, handshake_timeout_s: float,
                 refusals: RefusalLog | None = None):
        self._sock = sock
        self._timeout_s = handshake_timeout_s
        self._refusals = refusals or RefusalLog("bulk")
        self._pending: dict[bytes, _Pending] = {}
        self._task: asyncio.Task[None] | None = None
        self._hello_tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def bind(cls, host: str, port: int, handshake_timeout_s: float,
             refusals: RefusalLog | None = None) -> BulkListener:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
        return cls(sock, handshake_timeout_s, refusals)

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    def expect(self, session: Session, lane: int = 0
               ) -> tuple[bytes, asyncio.Future[socket.socket]]:
        """Register a one-time token for lane ``lane`` of a session about to be accepted."""
        token = secrets.token_bytes(TOKEN_BYTES)
        future = asyncio.get_running_loop().create_future()
        self._pending[token] = _Pending(session, future, lane)
        return token, future

    def forget(self, token: bytes) -> None:
        self._pending.pop(token, None)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:  # runs until close() cancels it
            conn, addr = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            task = loop.create_task(self._hello(conn, addr))
            self._hello_tasks.add(task)
            task.add_done_callback(self._hello_tasks.discard)

    async def _hello(self, conn: socket.socket, addr: object) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                hello = await _recv_exactly_async(loop, conn, CLIENT_HELLO_BYTES)
                pending = self._verify(hello)
                token = hello[4:4 + TOKEN_BYTES]
                await loop.sock_sendall(conn, BULK_MAGIC + pending.session.channel_mac(
                    lane_label(b"bulk server", pending.lane), token))
        except (ProtocolError, OSError, TimeoutError) as exc:
            self._refusals.refused(f"bulk channel from {_format_peer(addr)}", _describe(exc))
            conn.close()
            return
        if pending.future.done():  # the link gave up waiting meanwhile
            conn.close()
            return
        pending.future.set_result(conn)

    def _verify(self, hello: bytes) -> _Pending:
        if hello[:4] != BULK_MAGIC:
            raise BulkAuthError("not a bulk channel hello")
        token, mac = hello[4:4 + TOKEN_BYTES], hello[4 + TOKEN_BYTES:]
        pending = self._pending.pop(token, None)  # one-time: a replayed hello finds nothing
        if pending is None:
            raise BulkAuthError("unknown or already used bulk token")
        label = lane_label(b"bulk client", pending.lane)
        if not hmac.compare_digest(mac, pending.session.channel_mac(label, token)):
            raise BulkAuthError("bulk channel client MAC does not verify")
        return pending

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._hello_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pending in self._pending.values():
            pending.future.cancel()
        self._pending.clear()
        self._sock.close()


def _format_peer(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ProtocolError):
        return exc.message
    if isinstance(exc, TimeoutError):
        return "hello deadline passed"
    return f"{type(exc).__name__}: {exc}"
