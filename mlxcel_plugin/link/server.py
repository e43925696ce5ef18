"""Accepting links: ``serve_links`` runs the server handshake for each WebSocket.

Per connection: one deadline from the TCP accept to a ready link (WebSocket
upgrade, handshake, bulk attach; a slow-loris peer is dropped), then the
authenticated VERDICT. Over ``max_links`` the peer gets an at-capacity verdict
with a retry-after instead of a link. Any protocol failure closes with 1008;
failures before authentication are logged through a ``RefusalLog`` (one
WARNING line per interval, tracebacks at DEBUG), never naming the secret.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.bulk import make_channel
from mlxcel_plugin.link.bulk_attach import BulkListener
from mlxcel_plugin.link.connection import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_POLICY_VIOLATION,
    CLOSE_TRY_AGAIN_LATER,
    Link,
    LinkConfig,
    _format_address,
)
from mlxcel_plugin.link.protocol.handshake import ServerHandshake, Session
from mlxcel_plugin.link.protocol.handshake_messages import VerdictKind
from mlxcel_plugin.link.protocol.secret import ClusterSecret
from mlxcel_plugin.link.refusal_log import RefusalLog, UpgradeLogger

logger = logging.getLogger("mlxcel_plugin.link")

OnLink = Callable[[Link], Awaitable[None]]


class NotBinary(ProtocolError):
    code = "handshake_not_binary"


class TimedConnection(ServerConnection):
    """A server connection that knows when its TCP connection was accepted.

    The handshake deadline counts from there, so a peer that spends 4 s on the
    WebSocket upgrade has 1 s left, not a fresh 5 s (docs/protocol.md §2).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.accepted_at = asyncio.get_running_loop().time()


def parse_bind(bind: str) -> tuple[str, int]:
    """'host:port' (IPv6 as '[::1]:port') → (host, port)."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bind address {bind!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


async def recv_handshake_message(ws: Any) -> bytes:
    message = await ws.recv()
    if not isinstance(message, bytes):
        raise NotBinary("handshake message is not binary")
    return message


@dataclass
class LinkServer:
    """What ``serve_links`` returns: the bound address and the live links."""

    host: str
    port: int
    bulk_port: int | None
    links: set[Link] = field(default_factory=set)
    _ws_server: Server | None = None
    _bulk: BulkListener | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def close(self) -> None:
        """Stop accepting, close every link, release the ports."""
        if self._ws_server is not None:
            self._ws_server.close(close_connections=False)
        await asyncio.gather(*(link.close(1001, "server shutting down") for link in self.links))
        if self._ws_server is not None:
            await self._ws_server.wait_closed()
        if self._bulk is not None:
            await self._bulk.close()

    async def __aenter__(self) -> LinkServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


@dataclass
class _Admission:
    """One connection's claim: a reserved link slot and, maybe, a bulk token."""

    reserved: bool = False
    bulk_tokens: list[bytes] = field(default_factory=list)  # one per lane
    bulk_futures: list[asyncio.Future] = field(default_factory=list)
    taken: bool = False  # the lanes' sockets were handed to the link


@dataclass
class _Acceptor:
    """State shared by every connection of one ``serve_links`` call."""

    secret: ClusterSecret | bytes
    role: str
    node_id: str
    accept_roles: frozenset[str]
    on_link: OnLink
    max_links: int
    retry_after_s: float
    config: LinkConfig
    server: LinkServer
    bulk: BulkListener | None
    refusals: RefusalLog
    announce: Mapping[str, str] = field(default_factory=dict)  # e.g. the served model
    handshakes_in_flight: int = 0
    reserved: int = 0  # accepted, waiting for the bulk channel, not yet in server.links

    async def handle(self, ws: ServerConnection) -> None:
        if self.handshakes_in_flight >= 4 * self.max_links:
            await ws.close(CLOSE_TRY_AGAIN_LATER, "too many handshakes")
            return
        self.handshakes_in_flight += 1
        try:
            link = await self._establish(ws)
        finally:
            self.handshakes_in_flight -= 1
        if link is not None:
            await self._run(link)  # adds the link before any await: the slot stays counted

    # ---- handshake

    def _at_capacity(self) -> float | None:
        full = len(self.server.links) + self.reserved >= self.max_links
        return self.retry_after_s if full else None

    def _on_accept(self, session: Session, admission: _Admission) -> dict[str, Any]:
        self.reserved += 1
        admission.reserved = True
        if self.bulk is None or not session.peer.wants_bulk:
            return {**self.announce}
        lanes = min(session.peer.bulk_lanes, self.config.bulk_max_lanes)
        for lane in range(lanes):
            token, future = self.bulk.expect(session, lane)
            admission.bulk_tokens.append(token)
            admission.bulk_futures.append(future)
        # Lane 0's token where one-lane peers look for it; "bulk_lanes" only where asked.
        extra = {**self.announce, "bulk_port": self.bulk.port,
                 "bulk_token": admission.bulk_tokens[0],
                 "bulk_chunk_bytes": self.config.bulk_chunk_bytes}
        if lanes > 1:
            extra["bulk_lanes"] = lanes
            extra["bulk_lane_tokens"] = admission.bulk_tokens[1:]
        return extra

    async def _establish(self, ws: ServerConnection) -> Link | None:
        peer_addr = _format_address(ws.remote_address)
        admission = _Admission()
        hs = ServerHandshake(self.secret, self.role, self.node_id, self.accept_roles,
                             at_capacity=self._at_capacity,
                             accept_extra=lambda session: self._on_accept(session, admission),
                             max_record_bytes=self.config.max_record_bytes)
        accepted_at = getattr(ws, "accepted_at", asyncio.get_running_loop().time())
        try:
            async with asyncio.timeout_at(accepted_at + self.config.handshake_timeout_s):
                return await self._handshake(ws, hs, admission)
        except ProtocolError as exc:
            self._log_failure(hs, peer_addr, f"handshake failed: {exc.message}")
            await ws.close(CLOSE_POLICY_VIOLATION, exc.code or "protocol_error")
        except TimeoutError:
            self._log_failure(hs, peer_addr, f"handshake missed its "
                              f"{self.config.handshake_timeout_s:.1f}s deadline; dropped")
            await ws.close(CLOSE_POLICY_VIOLATION, "handshake_timeout")
        except ConnectionClosed:
            # Probes and port scans do this all day: not worth a line at INFO.
            logger.debug("link %s: %s went away during the handshake", self.node_id, peer_addr)
        finally:
            self._release(admission)
        return None

    def _log_failure(self, hs: ServerHandshake, peer_addr: str, reason: str) -> None:
        if hs.session is None:  # not authenticated: anyone can cause this, so rate-limited
            self.refusals.refused(peer_addr, reason)
        else:
            logger.warning("link %s: %s (%s %s): %s", self.node_id, peer_addr, hs.peer.role,
                           hs.peer.node_id, reason)

    def _release(self, admission: _Admission) -> None:
        if admission.reserved:
            self.reserved -= 1
        for token in admission.bulk_tokens:
            self.bulk.forget(token)
        for future in admission.bulk_futures:
            if not future.done():
                future.cancel()  # a late bulk hello then finds it done and closes
            elif not future.cancelled() and future.exception() is None and not admission.taken:
                future.result().close()  # a lane that came in for a link that never started

    async def _handshake(self, ws: ServerConnection, hs: ServerHandshake,
                         admission: _Admission) -> Link | None:
        await ws.send(hs.receive(await recv_handshake_message(ws)))
        await ws.send(hs.receive(await recv_handshake_message(ws)))  # the VERDICT record
        if hs.verdict.kind is not VerdictKind.ACCEPT:
            self._log_refusal(hs, ws)
            code = (CLOSE_TRY_AGAIN_LATER if hs.verdict.kind is VerdictKind.AT_CAPACITY
                    else CLOSE_POLICY_VIOLATION)
            await ws.close(code, hs.verdict.kind.value)
            return None
        socks = list(await asyncio.gather(*admission.bulk_futures))
        admission.taken = True  # the channels own the sockets from here
        bulk = [make_channel(sock, hs.session, self.config.bulk_chunk_bytes,
                             self.config.bulk_io_timeout_s, lane)
                for lane, sock in enumerate(socks)]
        return Link(ws, hs.session, self.config, bulk or None, local_role=self.role,
                    local_node_id=self.node_id)

    def _log_refusal(self, hs: ServerHandshake, ws: ServerConnection) -> None:
        peer = hs.peer
        logger.warning("link %s: refused %s (%s %s): %s", self.node_id,
                       _format_address(ws.remote_address), peer.role, peer.node_id,
                       hs.verdict.kind.value)

    # ---- running

    async def _run(self, link: Link) -> None:
        self.server.links.add(link)
        try:
            await self.on_link(link)
        except Exception:
            # The app's handler failed: log it with its traceback, close this link only.
            logger.exception("link %s: handler for %s failed", self.node_id, link.peer_node_id)
            await link.close(CLOSE_INTERNAL_ERROR, "handler failed", flush=False)
        finally:
            self.server.links.discard(link)
            await link.close()


async def serve_links(bind: str, secret: ClusterSecret | bytes, role: str, node_id: str,
                      accept_roles: Collection[str], on_link: OnLink, *, max_links: int = 64,
                      retry_after_s: float = 1.0, config: LinkConfig | None = None,
                      bulk_bind: str | None = None,
                      announce: Mapping[str, str] | None = None) -> LinkServer:
    """Listen on ``bind`` ("host:port", port 0 = any) and run ``on_link(link)`` per peer.

    ``accept_roles``: client roles this node takes (a decode node: prefill, router).
    The link closes when ``on_link`` returns. The bulk channel listens on
    ``bulk_bind`` (default: same host, any port), announced inside the verdict.
    ``announce``: string fields every accepted peer reads in the verdict
    (``Link.peer_announce``); a node announces its model (docs/protocol.md §2).
    """
    config = config or LinkConfig()
    host, port = parse_bind(bind)
    refusals = RefusalLog(node_id)
    bulk = None
    if config.bulk:
        bulk_host, bulk_port = parse_bind(bulk_bind) if bulk_bind else (host, 0)
        bulk = BulkListener.bind(bulk_host, bulk_port, config.handshake_timeout_s, refusals)
    server = LinkServer(host, port, bulk.port if bulk else None, _bulk=bulk)
    acceptor = _Acceptor(secret, role, node_id, frozenset(accept_roles), on_link, max_links,
                         retry_after_s, config, server, bulk, refusals, dict(announce or {}))
    ws_server = await serve(
        acceptor.handle, host, port, compression=None, max_size=config.ws_max_size,
        create_connection=TimedConnection, logger=UpgradeLogger(refusals),
        max_queue=config.ws_max_queue, open_timeout=config.handshake_timeout_s,
        ping_interval=config.ping_interval_s, ping_timeout=config.ping_timeout_s,
        close_timeout=config.close_timeout_s, server_header=None,
    )
    server._ws_server = ws_server
    server.port = ws_server.sockets[0].getsockname()[1]
    if bulk is not None:
        bulk.start()
    return server
