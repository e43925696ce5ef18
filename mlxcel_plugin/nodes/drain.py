"""Graceful drain on SIGTERM: take no new work, finish what is in flight, then stop.

The first SIGTERM or SIGINT begins the drain: readiness (``/health``,
``/health/ready``) answers 503 while ``/health/live`` stays 200, every router
link hears ERROR ``node_draining`` without a request id (the router stops
placing requests here), and a REQUEST that still arrives is refused with
``at_capacity`` (the router places it elsewhere). The node stops once nothing
is in flight, or after ``[node] drain_timeout_s``: what is left is cancelled,
the links close, and the routers migrate those requests. A second signal
stops at once. The process exits 0 either way (docs/cluster-flow.md,
"Failure detection and drain").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

from mlxcel_plugin.errors import AtCapacityError, NodeDrainingError
from mlxcel_plugin.link import Link, LinkClosed
from mlxcel_plugin.link.protocol.frames import ErrorFrame, Request

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0  # below Kubernetes' default grace period (30 s) plus its margin
DRAIN_POLL_S = 0.05
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM/SIGINT on the running loop: the first asks for a drain, the next to stop now."""

    def __init__(self) -> None:
        self.drain = asyncio.Event()
        self.stop_now = asyncio.Event()

    def on_signal(self) -> None:
        if self.drain.is_set():
            self.stop_now.set()
        else:
            self.drain.set()

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Handle the signals on the running loop while inside (main thread only)."""
        loop = asyncio.get_running_loop()
        installed = []
        for signum in STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signum, self.on_signal)  # off the main thread: skip
                installed.append(signum)
        try:
            yield self
        finally:
            for signum in installed:
                loop.remove_signal_handler(signum)


async def wait_drained(in_flight: Callable[[], int], timeout_s: float,
                       stop_now: asyncio.Event | None = None) -> int:
    """Until nothing is in flight, ``timeout_s`` passed, or ``stop_now``; returns what is left."""
    deadline_s = asyncio.get_running_loop().time() + timeout_s
    while (left := in_flight()) > 0:  # bounded by the deadline
        if asyncio.get_running_loop().time() >= deadline_s or (stop_now and stop_now.is_set()):
            return left
        await asyncio.sleep(DRAIN_POLL_S)
    return 0


class NodeDrain:
    """One node's drain: the gate for new requests, and the notice on its router links."""

    def __init__(self, node_id: str = "") -> None:
        self.node_id = node_id
        self.draining = False
        self._routers: set[Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def admit(self, request: Request) -> None:
        """Raises ``at_capacity`` once draining: any router re-places a refused request."""
        if self.draining:
            raise AtCapacityError(f"node {self.node_id} is draining", retry_after_s=1.0)

    def add_router(self, link: Link) -> None:
        self._routers.add(link)
        if self.draining:
            self._notify(link)

    def remove_router(self, link: Link) -> None:
        self._routers.discard(link)

    def begin(self) -> None:
        if self.draining:
            return
        self.draining = True
        logger.info("node %s draining: no new requests; %d router link(s) told", self.node_id,
                    len(self._routers))
        for link in self._routers:
            self._notify(link)

    def _notify(self, link: Link) -> None:
        task = asyncio.create_task(self._send_notice(link), name="drain-notice")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_notice(self, link: Link) -> None:
        notice = ErrorFrame(NodeDrainingError.code, f"node {self.node_id} is draining", None)
        try:
            await link.send(notice.to_frame())
        except LinkClosed:
            logger.debug("drain notice not sent: the link to %s closed", link.peer_node_id)
