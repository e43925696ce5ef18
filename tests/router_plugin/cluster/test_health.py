"""The health monitor's periodic check: a silent peer is dropped, a talking one is pinged.

Fake peers stand in for ``PeerLink`` (the real one is tested over loopback in
``test_peer_links.py``); the monitor runs on the real loop with short intervals.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from router_plugin.cluster.health import ALL_SILENT_GRACE, HealthConfig, HealthMonitor

pytestmark = pytest.mark.timeout(30)
FAST = HealthConfig(interval_s=0.05, ping_timeout_s=0.3)


class FakePeer:
    def __init__(self, node_id: str, answers: bool):
        self.node_id, self.answers = node_id, answers
        self.connected = True
        self.last_heard_s = time.monotonic()
        self.pings = 0
        self.dropped: str | None = None

    def silent_s(self) -> float:
        return time.monotonic() - self.last_heard_s

    def ping(self) -> None:
        self.pings += 1
        if self.answers:
            self.last_heard_s = time.monotonic()

    async def drop(self, reason: str) -> None:
        self.dropped, self.connected = reason, False


class FakePeers:
    def __init__(self, *peers: FakePeer):
        self.peers = {peer.node_id: peer for peer in peers}
        self.pool = None


def test_a_silent_peer_is_dropped_within_the_timeout_and_a_live_one_is_kept() -> None:
    async def main():
        hung, live = FakePeer("decode-0", answers=False), FakePeer("decode-1", answers=True)
        monitor = HealthMonitor(FakePeers(hung, live), FAST)
        started = time.monotonic()
        monitor.start()
        async with asyncio.timeout(5):
            while hung.dropped is None:  # bounded by the timeout
                await asyncio.sleep(0.01)
        took_s = time.monotonic() - started
        await asyncio.sleep(0.3)
        await monitor.close()
        assert took_s > FAST.ping_timeout_s  # never before the peer was silent that long
        assert "silent for" in hung.dropped and hung.pings >= 1
        assert live.dropped is None and live.pings >= 3

    asyncio.run(main())


def test_a_stalled_router_loop_does_not_drop_peers_it_could_not_read() -> None:
    async def main():
        quiet = FakePeer("decode-0", answers=True)
        monitor = HealthMonitor(FakePeers(quiet), FAST)
        monitor.start()
        await asyncio.sleep(0.1)
        time.sleep(0.6)  # the whole loop stalls: nothing read, the peer looks silent
        await asyncio.sleep(0.02)
        assert quiet.dropped is None  # the late tick only pings
        await asyncio.sleep(0.2)
        await monitor.close()
        assert quiet.dropped is None

    asyncio.run(main())


def test_every_peer_silent_at_once_is_dropped_only_after_the_grace() -> None:
    """Silence from all at once reads as this router starved; past the grace, they go."""
    async def main():
        peers = [FakePeer(f"decode-{i}", answers=False) for i in range(2)]
        monitor = HealthMonitor(FakePeers(*peers), FAST)
        started = time.monotonic()
        monitor.start()
        async with asyncio.timeout(5):
            while any(peer.dropped is None for peer in peers):  # bounded by the timeout
                await asyncio.sleep(0.01)
        took_s = time.monotonic() - started
        await monitor.close()
        assert took_s > ALL_SILENT_GRACE * FAST.ping_timeout_s
        assert all("silent for" in peer.dropped and peer.pings >= 3 for peer in peers)

    asyncio.run(main())
