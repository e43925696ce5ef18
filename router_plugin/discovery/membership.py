"""Runtime membership: the union of every source's snapshot becomes the router's pool.

A member no node holds yet joins: it gets a pool id and a ``PeerLink`` that dials
and handshakes it (with the cluster secret, like any peer) and gives it traffic
once it answers. A node no source lists any more drains: it takes no new request
(``NodeHealth.DRAINING``), its in-flight ones finish, and then its link closes
and it leaves the pool (after ``drain_timeout_s`` at the latest). A member whose
model fingerprint differs from the pool's, or a decode node outside
``MLXCEL_DECODE_ALLOWLIST``, is refused with one log line naming it.

Nodes are only drained once every source has reported: a slow first DNS answer
must not drain the static peers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.compatibility import text_refusal
from mlxcel_plugin.discovery_api import DiscoverySource, Member, Snapshot
from mlxcel_plugin.nodes.decode_allowlist import DecodeAllowlist
from router_plugin.cluster.peer_links import PeerLink, PeerLinks

ALLOW_ANY = DecodeAllowlist()
logger = logging.getLogger(__name__)

JOINED, LEFT, REFUSED, DRAINING = "joined", "left", "refused", "draining"
RECENT_CHANGES = 20
DRAIN_POLL_S = 0.1
SOURCE_RESTART_S = 5.0
Key = tuple[str, str]  # (role, address)


@dataclass(frozen=True)
class Change:
    change: str  # joined, draining, left, refused
    role: str
    node_id: str | None  # None for a refused member (it never had an id)
    source: str
    reason: str
    at_s: float


class Membership:
    """Applies snapshots to the pool and the links; ``run`` feeds it from the sources."""

    def __init__(self, peers: PeerLinks, make_peer: Callable[[str], PeerLink], *,
                 fingerprint: str | None, allowlist: DecodeAllowlist = ALLOW_ANY,
                 drain_timeout_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.peers, self.pool = peers, peers.pool
        self._make_peer, self._clock = make_peer, clock
        self.fingerprint, self.allowlist = fingerprint, allowlist
        self.drain_timeout_s = drain_timeout_s
        # Nodes already in the pool (the static flags) are members like the others.
        self._nodes: dict[Key, str] = {(self.pool.role(i), self.pool.address(i)): i
                                       for i in self.pool.ids()}
        self._snapshots: dict[str, Snapshot] = {}
        self._expected: set[str] = set()
        self._draining: dict[str, float] = {}  # node id -> since
        self._refused: set[tuple[Key, str]] = set()  # logged once while listed
        self.counts: Counter[tuple[str, str]] = Counter()  # (role, change) -> n
        self.recent: deque[Change] = deque(maxlen=RECENT_CHANGES)
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------ snapshots

    def expect(self, names: Iterable[str]) -> None:
        self._expected |= set(names)

    def update(self, source: str, snapshot: Snapshot) -> None:
        """``source`` now lists exactly ``snapshot``; join, refuse or drain accordingly."""
        self._snapshots[source] = snapshot
        # Sorted: ids are handed out in the same order whatever the sets' hashing.
        wanted = {m.key: m for snap in self._snapshots.values()
                  for m in sorted(snap, key=lambda member: member.key)}
        for key, member in wanted.items():
            self._want(key, member)
        self._refused = {(k, why) for k, why in self._refused if k in wanted}
        if self._expected <= set(self._snapshots):
            for key, node_id in list(self._nodes.items()):
                if key not in wanted and node_id not in self._draining:
                    self._start_drain(node_id, source)

    def _want(self, key: Key, member: Member) -> None:
        node_id = self._nodes.get(key)
        if node_id is None:
            reason = self.refusal(member)
            if reason is None:
                self._join(member)
            elif (key, reason) not in self._refused:
                self._refused.add((key, reason))
                self._record(REFUSED, member.role, None, member.source, reason)
                logger.warning("discovery (%s): refusing %s node %s: %s", member.source,
                               member.role, member.address, reason)
        elif node_id in self._draining:
            del self._draining[node_id]
            self.pool.undrain(node_id, self.peers[node_id].connected, self._clock())
            self._record(JOINED, member.role, node_id, member.source, "listed again")
            logger.info("discovery (%s): %s is listed again; serving", member.source, node_id)

    def refusal(self, member: Member) -> str | None:
        """Why ``member`` may not join, or None."""
        if member.fingerprint and self.fingerprint and member.fingerprint != self.fingerprint:
            return (f"model fingerprint {member.fingerprint} differs from the pool's "
                    f"{self.fingerprint}")
        pinned = member.profile
        refused = text_refusal(pinned, self.pool.pairing.router) if pinned is not None else None
        if refused is not None:  # the source pins another tokenizer or template than ours
            return f"{refused} (pinned by {member.source or 'discovery'})"
        if member.role == "decode" and not self.allowlist.allows(member.address):
            return "not in MLXCEL_DECODE_ALLOWLIST"
        return None

    def _join(self, member: Member) -> None:
        node_id = self.pool.add(member.role, member.address)
        self._nodes[member.key] = node_id
        self.peers.add(self._make_peer(node_id))
        self._record(JOINED, member.role, node_id, member.source, "")
        logger.info("discovery (%s): %s joined at %s", member.source, node_id, member.address)

    def _start_drain(self, node_id: str, source: str) -> None:
        now = self._clock()
        self._draining[node_id] = now
        self.pool.mark_draining(node_id, now)
        self._record(DRAINING, self.pool.role(node_id), node_id, source, "no longer listed")
        logger.info("discovery: %s is no longer listed; draining %d in-flight request(s)",
                    node_id, self.pool.in_flight(node_id))

    # ------------------------------------------------------------ drains

    async def finish_drains(self) -> None:
        """Drop drained nodes; keep the others draining (a reconnect must not undrain one)."""
        now = self._clock()
        for node_id, since_s in list(self._draining.items()):
            busy = self.pool.in_flight(node_id)
            if busy and now - since_s < self.drain_timeout_s:
                self.pool.mark_draining(node_id, now)
                continue
            await self._leave(node_id, busy)

    async def _leave(self, node_id: str, busy: int) -> None:
        role, address = self.pool.role(node_id), self.pool.address(node_id)
        del self._draining[node_id]
        del self._nodes[(role, address)]
        await self.peers.remove(node_id)
        self.pool.remove(node_id)
        reason = f"drain timed out with {busy} in flight" if busy else "drained"
        self._record(LEFT, role, node_id, "", reason)
        logger.info("discovery: %s left the pool (%s)", node_id, reason)

    # ------------------------------------------------------------ running

    def start(self, sources: Iterable[DiscoverySource]) -> None:
        sources = list(sources)
        self.expect(source.name for source in sources)
        self._tasks = [asyncio.create_task(self._follow(s), name=f"discovery-{s.name}")
                       for s in sources]
        self._tasks.append(asyncio.create_task(self._drain_loop(), name="discovery-drains"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _follow(self, source: DiscoverySource) -> None:
        while True:  # a failing source is restarted; close() cancels it
            try:
                async for snapshot in source.watch():
                    self.update(source.name, snapshot)
            except Exception:  # one broken source must not stop the others: log, retry
                logger.exception("discovery source %s failed; restarting in %.0fs",
                                 source.name, SOURCE_RESTART_S)
            await asyncio.sleep(SOURCE_RESTART_S)

    async def _drain_loop(self) -> None:
        while True:
            await self.finish_drains()
            await asyncio.sleep(DRAIN_POLL_S)

    # ------------------------------------------------------------ reading

    def _record(self, change: str, role: str, node_id: str | None, source: str,
                reason: str) -> None:
        self.counts[(role, change)] += 1
        self.recent.append(Change(change, role, node_id, source, reason, self._clock()))

    def stats(self) -> dict[str, Any]:
        """The ``membership`` part of ``GET /router/stats`` (ids, never addresses)."""
        now = self._clock()
        return {
            "sources": sorted(self._expected),
            "draining": sorted(self._draining),
            "changes": {f"{role}_{change}": n for (role, change), n in sorted(self.counts.items())},
            "recent": [{"change": c.change, "role": c.role, "node": c.node_id,
                        "source": c.source, "reason": c.reason, "age_s": now - c.at_s}
                       for c in self.recent],
        }


def with_membership(route: Callable[[], Mapping[str, Any]],
                    membership: Membership) -> Callable[[], dict[str, Any]]:
    """``/router/stats`` plus a ``membership`` section."""

    def router_stats() -> dict[str, Any]:
        return {**route(), "membership": membership.stats()}

    return router_stats
