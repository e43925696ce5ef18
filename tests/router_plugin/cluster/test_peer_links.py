"""PeerLinks over real loopback links: dispatch by request id, telemetry, loss, reconnect."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from mlxcel_plugin.errors import NodeDrainingError
from mlxcel_plugin.link import Backoff, serve_links
from mlxcel_plugin.link.protocol.frames import ErrorFrame, Result
from mlxcel_plugin.testing.fake_peers import SECRET, FakeDecode, FakePrefill
from router_plugin.cluster.node_pool import NodeHealth, NodePool
from router_plugin.cluster.peer_links import PeerEvent, PeerLinks, make_dialer

pytestmark = pytest.mark.timeout(30)
FAST = Backoff(initial_s=0.02, max_s=0.1)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # bounded by the timeout
            await asyncio.sleep(0.01)


async def started(*nodes):
    for node in nodes:
        await node.start()
    pool = NodePool.from_peers([n.address for n in nodes if n.role == "prefill"],
                               [n.address for n in nodes if n.role == "decode"])
    peers = PeerLinks(pool, make_dialer(SECRET, "router-test"), backoff=FAST)
    peers.start()
    await wait_for(lambda: all(p.connected for p in peers.peers.values()))
    return pool, peers


def test_connects_marks_healthy_and_takes_telemetry() -> None:
    async def main():
        prefill, decode = FakePrefill(), FakeDecode()
        pool, peers = await started(prefill, decode)
        assert [pool.health(i) for i in pool.ids()] == [NodeHealth.HEALTHY] * 2
        await wait_for(lambda: pool.stats(time.monotonic())["decode"][0]["telemetry"] is not None)
        await peers.close()
        for node in (prefill, decode):
            await node.stop()

    run(main())


def test_results_and_errors_go_to_the_request_sink() -> None:
    async def main():
        decode = FakeDecode()
        pool, peers = await started(decode)
        peer = peers["decode-0"]
        got: list[PeerEvent] = []
        peer.register("r1", got.append)
        node_link = next(iter(decode.links))
        await node_link.send(Result("r1", 1, [7]).to_frame())
        await node_link.send(Result("other", 1, [8]).to_frame())  # nobody waits: dropped
        await node_link.send(ErrorFrame("engine_error", "boom", "r1").to_frame())
        await wait_for(lambda: len(got) == 2)
        assert got[0].result == Result("r1", 1, [7]) and got[0].source == "decode"
        assert (got[1].error, got[1].code) == ("boom", "engine_error")
        peer.unregister("r1")
        await node_link.send(Result("r1", 2, [9]).to_frame())
        await asyncio.sleep(0.05)
        assert len(got) == 2
        await peers.close()
        await decode.stop()

    run(main())


def test_lost_link_fails_requests_then_reconnects_on_the_same_port() -> None:
    async def main():
        prefill = FakePrefill()
        pool, peers = await started(prefill)
        peer = peers["prefill-0"]
        got: list[PeerEvent] = []
        peer.register("r1", got.append)
        await prefill.stop()
        await wait_for(lambda: got)
        assert got[0].lost and got[0].code == "node_lost"
        assert pool.health("prefill-0") is NodeHealth.UNREACHABLE
        assert not await peer.probe(0.2)
        await prefill.start()  # same bind as before
        assert await peer.probe(1.0)
        assert pool.health("prefill-0") is NodeHealth.HEALTHY
        assert await peer.probe(1.0)  # a live link answers PING
        await peers.close()
        await prefill.stop()

    run(main())


def test_a_peer_of_the_wrong_role_is_refused() -> None:
    async def main():
        decode = await FakeDecode().start()
        pool = NodePool.from_peers([decode.address], [])  # configured as a prefill node
        peers = PeerLinks(pool, make_dialer(SECRET, "router-test"), backoff=FAST)
        peers.start()
        await wait_for(lambda: pool.health("prefill-0") is NodeHealth.UNREACHABLE)
        assert not peers["prefill-0"].connected
        await peers.close()
        await decode.stop()

    run(main())


def test_a_peer_that_fails_right_after_each_handshake_is_redialed_with_backoff(caplog) -> None:
    """Before backoff across links, such a peer got thousands of dials in seconds."""

    async def main():
        accepted = []

        async def close_at_once(link):
            accepted.append(link)  # the link closes when this returns

        server = await serve_links("127.0.0.1:0", SECRET, "decode", "flaky", {"router"},
                                   close_at_once)
        pool = NodePool.from_peers([], [f"127.0.0.1:{server.port}"])
        peers = PeerLinks(pool, make_dialer(SECRET, "router-test"),
                          backoff=Backoff(initial_s=0.02, max_s=0.2))
        with caplog.at_level(logging.INFO):
            peers.start()
            for _ in range(20):  # 2 s of 0.1 s re-probes, which must not cut the backoff short
                await peers["decode-0"].probe(0.1)
            await peers.close()
        await server.close()
        # 0.02 + 0.04 + 0.08 + 0.16 s, then every 0.2 s: about 12 dials in 2 s.
        assert 5 <= len(accepted) <= 25
        # Every dial was accepted, but one the close cut short in its handshake.
        assert len(accepted) <= peers["decode-0"].redial.dials <= len(accepted) + 1
        router_lines = [r for r in caplog.records if r.name.startswith(("router_plugin",
                                                                         "mlxcel_plugin"))
                        and r.levelno >= logging.WARNING]
        assert len(router_lines) <= 8  # one per backoff step below the cap, then quiet

    run(main())


def test_a_draining_node_is_marked_draining_and_healthy_again_after_a_reconnect() -> None:
    async def main():
        decode = FakeDecode()
        pool, peers = await started(decode)
        node_link = next(iter(decode.links))
        await node_link.send(ErrorFrame(NodeDrainingError.code, "bye", None).to_frame())
        await wait_for(lambda: pool.health("decode-0") is NodeHealth.DRAINING)
        assert not pool.views("decode", time.monotonic())[0].healthy  # no new placements
        await decode.stop()
        await wait_for(lambda: pool.health("decode-0") is NodeHealth.UNREACHABLE)
        await decode.start()
        await wait_for(lambda: pool.health("decode-0") is NodeHealth.HEALTHY)
        await peers.close()
        await decode.stop()

    run(main())


def test_every_frame_is_a_sign_of_life_and_ping_asks_for_one() -> None:
    async def main():
        decode = FakeDecode(telemetry_interval_s=60.0)
        pool, peers = await started(decode)
        peer = peers["decode-0"]
        await asyncio.sleep(0.2)
        assert peer.silent_s() >= 0.2
        peer.ping()  # the node's link answers on its reader task
        await wait_for(lambda: peer.silent_s() < 0.1)
        await peers.close()
        await decode.stop()

    run(main())
