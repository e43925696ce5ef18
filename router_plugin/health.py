"""Health of the router's peers: a periodic probe, and the re-probe before a refusal.

The monitor probes every peer each ``interval_s``: a connected peer must
answer a PING within ``ping_timeout_s`` (else its link is closed and its
requests fail over); a disconnected one gets its dialer woken early, so a
restarted node is back in the pool within about one interval.

Before answering 503 because no prefill (or decode) node is healthy, the
router asks ``reprobe``: single-flight through ``ReprobeGate`` (at most one
probe router-wide per 250 ms, each bounded by a 500 ms connect timeout);
concurrent refusals wait for the probe already in flight instead of starting
their own. A full queue never probes: the nodes are up, just busy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.config import dataclass_from_mapping
from router_plugin.admission import RefusalCause, ReprobeGate
from router_plugin.node_pool import NodeHealth
from router_plugin.peer_links import PeerLink, PeerLinks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthConfig:
    """TOML section ``[health]``."""

    interval_s: float = 1.0
    ping_timeout_s: float = 5.0  # generous: a busy 2-core node still answers in time
    reprobe_min_interval_s: float = 0.25
    reprobe_connect_timeout_s: float = 0.5

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> HealthConfig:
        return dataclass_from_mapping(cls, section, "[health]")


class HealthMonitor:
    def __init__(self, peers: PeerLinks, config: HealthConfig = HealthConfig(), *,
                 clock: Callable[[], float] = time.monotonic):
        self.peers, self.config, self._clock = peers, config, clock
        self.gate = ReprobeGate(config.reprobe_min_interval_s, config.reprobe_connect_timeout_s)
        self._reprobe: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.reprobes = 0  # probes actually started (stats, tests)

    # ------------------------------------------------------------ periodic probe

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-monitor")

    async def close(self) -> None:
        for task in (self._task, self._reprobe):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:  # until close() cancels it
            await asyncio.sleep(self.config.interval_s)
            await asyncio.gather(*(self._probe(peer) for peer in self.peers.peers.values()))

    async def _probe(self, peer: PeerLink) -> None:
        if peer.connected:
            if not await peer.probe(self.config.ping_timeout_s):
                await peer.drop(f"no PONG within {self.config.ping_timeout_s}s")
        elif self.peers.pool.health(peer.node_id) is not NodeHealth.DRAINING:
            await peer.probe(self.config.reprobe_connect_timeout_s)

    # ------------------------------------------------------------ re-probe before a refusal

    async def reprobe(self, role: str, cause: RefusalCause = RefusalCause.NO_HEALTHY_NODE
                      ) -> None:
        """Give unreachable ``role`` peers one quick chance before the caller refuses.

        Returns when the probe this call started or joined is over (or at once,
        when the gate says a probe ran too recently).
        """
        if self._reprobe is not None and not self._reprobe.done():
            await asyncio.shield(self._reprobe)
            return
        if not self.gate.try_begin(self._clock(), cause):
            return
        self.reprobes += 1
        self._reprobe = asyncio.create_task(self._reprobe_role(role), name="reprobe")
        await asyncio.shield(self._reprobe)

    async def _reprobe_role(self, role: str) -> None:
        timeout_s = self.config.reprobe_connect_timeout_s
        candidates = set(self.peers.pool.probe_candidates(role))
        try:
            await asyncio.gather(*(peer.probe(timeout_s) for peer in self.peers.of_role(role)
                                   if peer.node_id in candidates))
        finally:
            self.gate.end()
