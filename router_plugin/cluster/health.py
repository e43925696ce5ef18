"""Health of the router's peers: a periodic probe, and the re-probe before a refusal.

Every ``interval_s`` the monitor pings each connected peer and drops the
link of one that sent nothing at all (no telemetry, result or PONG) for
``ping_timeout_s``: a hung node (SIGSTOP, a wedged loop) is marked
unreachable within ``ping_timeout_s`` + one interval, and its requests hear
``lost`` at once (the link is aborted, not closed with a handshake the hung
peer would never answer). Nodes answer PINGs on their link's reader task,
not behind the engine, so a busy node still answers. Disconnected peers are
redialed by their own dialers, with backoff. Silence the router may have caused
itself drops nothing at once: a tick that came late (this loop stalled) only
pings, and every connected peer silent in the same round (this process starved
of CPU, reading late) is dropped only once silent for three timeouts.

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
from router_plugin.cluster.admission import RefusalCause, ReprobeGate
from router_plugin.cluster.peer_links import PeerLink, PeerLinks

logger = logging.getLogger(__name__)
ALL_SILENT_GRACE = 3  # ping timeouts: every peer silent at once is dropped only after this


@dataclass(frozen=True)
class HealthConfig:
    """TOML section ``[health]``."""

    interval_s: float = 0.5
    # Nodes send telemetry every 0.5 s and PONG on their reader task: 1.5 s of silence
    # is a hung node, not a busy one (docs/cluster-flow.md, "Failure detection and drain").
    ping_timeout_s: float = 1.5
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
        interval_s = self.config.interval_s
        last_tick_s = self._clock()
        while True:  # until close() cancels it
            await asyncio.sleep(interval_s)
            now = self._clock()
            # A tick this late means this loop stalled: what peers sent meanwhile may still
            # be unread, so their silence proves nothing this round.
            stalled = now - last_tick_s > interval_s + self.config.ping_timeout_s / 2
            last_tick_s = now
            peers = list(self.peers.peers.values())
            stalled = stalled or self._all_silent_at_once(peers)
            await asyncio.gather(*(self._check(peer, stalled) for peer in peers))

    def _all_silent_at_once(self, peers: list[PeerLink]) -> bool:
        """Every connected peer (two or more) past the timeout in the same round, none yet
        past ``ALL_SILENT_GRACE`` timeouts: more likely this router, starved of CPU and
        reading late, than every node hung at once (as memberlist's Lifeguard reasons)."""
        silences = [peer.silent_s() for peer in peers if peer.connected]
        timeout_s = self.config.ping_timeout_s
        if len(silences) < 2 or min(silences) <= timeout_s:
            return False
        if max(silences) > ALL_SILENT_GRACE * timeout_s:
            return False  # long enough: they are gone, or this router cannot serve anyway
        logger.warning("every peer silent for %.1f-%.1fs at once: reading late, not dropping "
                       "them before %.1fs", min(silences), max(silences),
                       ALL_SILENT_GRACE * timeout_s)
        return True

    async def _check(self, peer: PeerLink, stalled: bool) -> None:
        if not peer.connected:
            return
        silent_s = peer.silent_s()
        if silent_s > self.config.ping_timeout_s and not stalled:
            await peer.drop(f"silent for {silent_s:.1f}s (ping_timeout_s "
                            f"{self.config.ping_timeout_s})")
        else:
            peer.ping()

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
