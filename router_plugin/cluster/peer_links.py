"""The router's links to its prefill and decode nodes: one long-lived link per peer.

Each ``PeerLink`` dials its peer with backoff and keeps it: a reader task
hands RESULT/ERROR frames to the per-request sink registered under their
``request_id``, and TELEMETRY to the node pool. When the link drops, the peer
is marked Unreachable, every request routed over it hears ``lost`` (the
cluster backend re-routes or ends it), and the peer is dialed again in the
background; once it answers, the pool marks it Healthy and it takes traffic
again. Redials back off (``Redial``): a peer that fails right after each
handshake is dialed ever more slowly, up to the backoff's cap. A re-probe
before a refusal wakes the dialer early (``probe``) instead of dialing on its
own, so there is only ever one dialer per peer. Every frame the peer sends
counts as a sign of life (``silent_s``); the health monitor drops a link that
stays silent too long (``abort``: no close handshake with a hung peer). A node
that says it is draining (ERROR ``node_draining``) is marked Draining: it
finishes what it has and gets nothing new.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, fields

from mlxcel_plugin.compatibility import NodeProfile
from mlxcel_plugin.errors import (
    HandshakeError,
    ModelMismatchError,
    NodeDrainingError,
    NodeLostError,
)
from mlxcel_plugin.link import RETRYABLE, Backoff, ClusterSecret, Link, LinkConfig, dial_link
from mlxcel_plugin.link.dial import Redial
from mlxcel_plugin.link.protocol.frames import (
    AdapterCommand,
    Cancel,
    ErrorFrame,
    Frame,
    FrameType,
    Ping,
    Result,
    Telemetry,
)
from mlxcel_plugin.link.protocol.handshake_messages import PeerAtCapacity
from router_plugin.cluster.node_pool import NodePool, NodeTelemetry

logger = logging.getLogger(__name__)

ROUTER_ROLE = "router"
# The router only sends small control frames: no bulk channel (a socket and two threads each).
ROUTER_LINK_CONFIG = LinkConfig(bulk=False)
DEFAULT_BACKOFF = Backoff(initial_s=0.1, max_s=2.0)


@dataclass(frozen=True)
class PeerEvent:
    """What a peer said about one request: a result, an error, or that it went away."""

    source: str  # the peer's role: "prefill" or "decode"
    node_id: str
    result: Result | None = None
    error: str | None = None
    code: str | None = None  # errors.py code of an ERROR frame
    lost: bool = False
    adapter: AdapterCommand | None = None  # a node's answer to an ADAPTER command


Sink = Callable[[PeerEvent], None]
Dialer = Callable[[str, str], Awaitable[Link]]  # (address, expected role) -> Link
Clock = Callable[[], float]


def make_dialer(secret: ClusterSecret | bytes, node_id: str,
                config: LinkConfig = ROUTER_LINK_CONFIG,
                expected_model: str | None = None) -> Dialer:
    """Dial as the router, refusing a peer whose handshake names another role.

    With ``expected_model`` (the router's checkpoint digest), a node that announces
    another model is refused too (``ModelMismatchError``, redialled with backoff).
    """

    async def dial(address: str, role: str) -> Link:
        link = await _dial(address, role)
        announced = link.peer_announce.get("model")
        if expected_model and announced and announced != expected_model:
            await link.close()
            raise ModelMismatchError(f"{address} serves model {announced}, this router's "
                                     f"is {expected_model}: refused")
        return link

    async def _dial(address: str, role: str) -> Link:
        return await dial_link(address, secret, ROUTER_ROLE, node_id, expect_roles={role},
                               config=config)

    return dial


class PeerLink:
    """One peer: its link (when up), the requests routed over it, and its dialer task."""

    def __init__(self, node_id: str, role: str, address: str, dial: Dialer, pool: NodePool, *,
                 backoff: Backoff = DEFAULT_BACKOFF, clock: Clock = time.monotonic,
                 on_change: Callable[[], None] = lambda: None):
        self.node_id, self.role, self.address = node_id, role, address
        self._dial, self._pool, self._clock = dial, pool, clock
        self.redial = Redial(backoff, f"router link to {node_id}", clock=clock)
        self.last_heard_s = clock()
        self.on_change = on_change  # load or health changed: the admission queue may move
        self.on_connect: Callable[[PeerLink], None] = lambda peer: None  # (re)connected
        self.link: Link | None = None
        self._routes: dict[str, Sink] = {}
        self._wake = asyncio.Event()
        self._attempted = asyncio.Event()  # set after every dial attempt
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self._next_nonce = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self.link is not None and not self.link.closed

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"peer-{self.node_id}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.link is not None:
            await self.link.close()

    # ------------------------------------------------------------ requests

    def register(self, request_id: str, sink: Sink) -> None:
        self._routes[request_id] = sink

    def unregister(self, request_id: str) -> None:
        self._routes.pop(request_id, None)

    async def send(self, frame: Frame) -> None:
        """Send one frame; raises NodeLostError when the peer is not connected."""
        link = self.link
        if link is None or link.closed:
            raise NodeLostError(f"{self.node_id} is not connected")
        await link.send(frame)

    async def cancel(self, request_id: str, reason: str) -> None:
        """Best effort: a peer that is gone has already dropped the request."""
        if not self.connected:
            return
        try:
            await self.send(Cancel(request_id, reason).to_frame())
        except NodeLostError:
            logger.debug("cancel of %s not sent: %s went away", request_id, self.node_id)

    # ------------------------------------------------------------ probing

    async def probe(self, timeout_s: float) -> bool:
        """Connected and answering? Pings a live link; wakes the dialer for a dead one."""
        if self.connected:
            return await self._ping(timeout_s)
        self._attempted.clear()
        self._wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                await self._attempted.wait()
        except TimeoutError:
            return False
        return self.connected

    def silent_s(self) -> float:
        """Seconds since the peer last sent anything (telemetry, results, pongs)."""
        return self._clock() - self.last_heard_s

    def ping(self) -> None:
        """Ask for a sign of life without waiting for it (the PONG refreshes ``silent_s``)."""
        self._next_nonce += 1
        link = self.link
        if link is not None and not link.closed:
            link.try_send(Ping(self._next_nonce, self._clock()).to_frame())  # full: it is busy

    async def _ping(self, timeout_s: float) -> bool:
        self._next_nonce += 1
        nonce = self._next_nonce
        waiter = asyncio.get_running_loop().create_future()
        self._pongs[nonce] = waiter
        try:
            await self.send(Ping(nonce, self._clock()).to_frame())
            async with asyncio.timeout(timeout_s):
                await waiter
            return True
        except (TimeoutError, NodeLostError):
            return False
        finally:
            self._pongs.pop(nonce, None)

    async def drop(self, reason: str) -> None:
        """Drop a link that stopped answering, at once; the reader then fails its requests."""
        link = self.link
        if link is not None:
            logger.warning("dropping the link to %s: %s", self.node_id, reason)
            await link.abort()

    # ------------------------------------------------------------ the dialer/reader task

    async def _run(self) -> None:
        while True:  # until close() cancels the task
            link = await self._connect()
            self.link, self.last_heard_s = link, self._clock()
            self.redial.connected()
            self._announced(link)
            self._pool.mark_healthy(self.node_id, self._clock())
            if not self.redial.flapping:  # a flapping peer is logged per backoff step instead
                logger.info("connected to %s (%s %s)", self.node_id, link.peer_role,
                            link.peer_node_id)
            self.on_change()
            self.on_connect(self)
            error = await self._read(link)
            delay_s = self.redial.lost()
            self._lost(link, error)
            if delay_s > 0:
                await self._sleep_or_wake(delay_s)

    def _announced(self, link: Link) -> None:
        """Its KV, tokenizer and template, as its verdict says: who it may pair with."""
        profile = NodeProfile.from_announce(link.peer_announce)
        refusals = self._pool.pairing.set_profile(self.node_id, self.role, profile)
        if refusals:  # one line per node newly refused (or in a newly refused pair)
            kv = profile.kv.summary() if profile.kv else "kv unknown"
            logger.warning("refusing %s (%s) for %s", self.node_id, kv,
                           "; ".join(f"{r.partner}: {r.reason}" for r in refusals))

    async def _connect(self) -> Link:
        while True:  # until a dial succeeds; each failure sleeps with backoff
            self.redial.dialing()
            try:
                link = await self._dial(self.address, self.role)
            except RETRYABLE as exc:
                # An at-capacity peer is not asked again before the retry-after it announced.
                retry_after_s = exc.retry_after_s if isinstance(exc, PeerAtCapacity) else 0.0
                delay_s = self.redial.failed(f"dial failed: {type(exc).__name__}", retry_after_s)
                self._dial_failed(type(exc).__name__)
            except HandshakeError as exc:
                # Wrong secret, role or version: will not heal by itself; retry slowly.
                delay_s = self.redial.failed(f"handshake refused: {exc.message}",
                                             self.redial.backoff.max_s)
                self._dial_failed(exc.code or "handshake_failed")
            else:
                self._attempted.set()
                return link
            await self._sleep_or_wake(delay_s)

    def _dial_failed(self, error: str) -> None:
        self._pool.mark_unreachable(self.node_id, self._clock(), error)  # Redial logs it
        self._attempted.set()

    async def _sleep_or_wake(self, delay_s: float) -> None:
        """Wait out a backoff delay; a re-probe may cut it short, except for a flapping peer."""
        self._wake.clear()
        try:
            async with asyncio.timeout(delay_s):
                while True:  # until the timeout, or a wake that may shorten the delay
                    await self._wake.wait()
                    if not self.redial.flapping:
                        return
                    self._wake.clear()  # the probe waits for the attempt the backoff makes
        except TimeoutError:
            return

    async def _read(self, link: Link) -> str:
        """Dispatch frames (on the link's reader) until the link closes; returns why.

        A malformed frame raises ProtocolError in ``_dispatch``: the link closes
        with 1008 and logs it, naming the peer; this link cannot be trusted any more.
        """
        link.deliver_to(self._dispatch)
        await link.wait_closed()
        return link.error.code if link.error is not None else "link closed"

    def _lost(self, link: Link, error: str) -> None:
        self.link = None
        changed = self._pool.mark_unreachable(self.node_id, self._clock(), error)
        if changed and not self.redial.flapping:
            logger.warning("lost the link to %s (%s)", self.node_id, error)
        routes, self._routes = self._routes, {}
        for sink in routes.values():
            sink(PeerEvent(self.role, self.node_id, error=f"{self.role} node lost", lost=True,
                           code="node_lost"))
        for waiter in self._pongs.values():
            if not waiter.done():
                waiter.set_exception(NodeLostError(f"{self.node_id} lost"))
        self.on_change()

    # ------------------------------------------------------------ frames

    def _dispatch(self, frame: Frame) -> None:
        self.last_heard_s = self._clock()
        kind = frame.type
        if kind is FrameType.RESULT:
            result = Result.from_frame(frame)
            self._deliver(result.request_id, PeerEvent(self.role, self.node_id, result=result))
        elif kind is FrameType.TELEMETRY:
            self._telemetry(Telemetry.from_frame(frame))
        elif kind is FrameType.ERROR:
            self._error(ErrorFrame.from_frame(frame))
        elif kind is FrameType.ADAPTER:  # routed by command id (cluster/adapter_commands.py)
            reply = AdapterCommand.from_frame(frame)
            self._deliver(reply.command_id, PeerEvent(self.role, self.node_id, adapter=reply))
        elif kind is FrameType.PONG:
            waiter = self._pongs.get(Ping.from_frame(frame).nonce)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        else:
            logger.debug("ignoring a %s frame from %s", kind.name, self.node_id)

    def _deliver(self, request_id: str, event: PeerEvent) -> None:
        sink = self._routes.get(request_id)
        if sink is not None:
            sink(event)
        # else: a late frame for a finished or cancelled request; nothing waits for it.

    def _error(self, error: ErrorFrame) -> None:
        if error.request_id is None and error.code == NodeDrainingError.code:
            if self._pool.mark_draining(self.node_id, self._clock()):
                logger.info("%s is draining: no new requests go there", self.node_id)
                self.on_change()
            return
        if error.request_id is None:
            logger.warning("%s reported %s: %s", self.node_id, error.code, error.message)
            return
        message = error.message or error.code
        self._deliver(error.request_id, PeerEvent(self.role, self.node_id, error=message,
                                                  code=error.code))

    def _telemetry(self, report: Telemetry) -> None:
        # NodeTelemetry keeps the report's load fields under the same names.
        telemetry = NodeTelemetry(**{f.name: getattr(report, f.name)
                                     for f in fields(NodeTelemetry)})
        self._pool.update_telemetry(self.node_id, telemetry, self._clock())
        self.on_change()


class PeerLinks:
    """Every peer of the router, by pool id."""

    def __init__(self, pool: NodePool, dial: Dialer, *, backoff: Backoff = DEFAULT_BACKOFF,
                 clock: Clock = time.monotonic, on_change: Callable[[], None] = lambda: None):
        self.pool = pool
        self.peers: dict[str, PeerLink] = {
            node_id: PeerLink(node_id, pool.role(node_id), pool.address(node_id), dial, pool,
                              backoff=backoff, clock=clock, on_change=on_change)
            for node_id in pool.ids()
        }
        self._on_connect: Callable[[PeerLink], None] | None = None

    def set_on_connect(self, on_connect: Callable[[PeerLink], None]) -> None:
        """Who hears that a peer, present or joining later, has (re)connected (its adapters)."""
        self._on_connect = on_connect
        for peer in self.peers.values():
            peer.on_connect = on_connect

    def set_on_change(self, on_change: Callable[[], None]) -> None:
        """Who hears that load or health changed (the backend's admission queue)."""
        for peer in self.peers.values():
            peer.on_change = on_change

    def __getitem__(self, node_id: str) -> PeerLink:
        return self.peers[node_id]

    def of_role(self, role: str) -> Iterable[PeerLink]:
        return (peer for peer in self.peers.values() if peer.role == role)

    def start(self) -> None:
        for peer in self.peers.values():
            peer.start()

    async def close(self) -> None:
        await asyncio.gather(*(peer.close() for peer in self.peers.values()))

    def add(self, peer: PeerLink) -> None:
        """A peer that joined at runtime (discovery): keep it and start dialing it."""
        self.peers[peer.node_id] = peer
        if self._on_connect is not None:
            peer.on_connect = self._on_connect
        peer.start()

    async def remove(self, node_id: str) -> None:
        """A peer that left and drained: close its link and forget it."""
        peer = self.peers.pop(node_id, None)
        if peer is not None:
            await peer.close()
