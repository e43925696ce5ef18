"""RoutedRequest with a hand-built RoutingContext: everything it uses of the router is passed in."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Collection, Sequence

import pytest

from mlxcel_plugin.balancer_api import RequestInfo
from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest, TokenEvent
from mlxcel_plugin.link import Backoff
from mlxcel_plugin.link.protocol.frames import Result
from mlxcel_plugin.testing.fake_peers import EOS, SECRET, FakeDecode, FakePrefill, echo_script
from router_plugin.cluster.node_pool import NodePool
from router_plugin.cluster.peer_links import PeerEvent, PeerLink, PeerLinks, make_dialer
from router_plugin.cluster.routed_request import (
    RoutedRequest,
    RoutingContext,
    failed_result_as_error,
    wire_id,
)
from router_plugin.cluster.stats import RouterStats

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


class Router:
    """Two prefill nodes, one decode node, and a context whose calls are recorded."""

    def __init__(self, prefills: list[FakePrefill], decode: FakeDecode, peers: PeerLinks):
        self.prefills, self.decode, self.peers = prefills, decode, peers
        self.selections: list[tuple[str, str, set[str]]] = []
        self.load_changes = 0
        self.stats = RouterStats()

    async def select(self, role: str, info: RequestInfo, excluded: Collection[str],
                     blocks: Sequence[int] = ()) -> PeerLink:
        # The first node of the role not excluded, in id order: no balancer involved.
        self.selections.append((role, info.request_id, set(excluded)))
        node_id = next(n for n in sorted(self.peers.peers) if n.startswith(role)
                       and n not in excluded)
        return self.peers[node_id]

    def on_load_change(self) -> None:
        self.load_changes += 1

    def context(self, max_placements: int = 3) -> RoutingContext:
        return RoutingContext(select=self.select, pool=self.peers.pool, stats=self.stats,
                              on_load_change=self.on_load_change,
                              max_placements=max_placements)

    async def close(self) -> None:
        await self.peers.close()
        for node in (*self.prefills, self.decode):
            await node.stop()


async def router() -> Router:
    decode = await FakeDecode(node_id="d0").start()
    prefills = [await FakePrefill(node_id=f"p{i}", decodes={decode.address: decode}).start()
                for i in range(2)]
    pool = NodePool.from_peers([p.address for p in prefills], [decode.address])
    peers = PeerLinks(pool, make_dialer(SECRET, "router-test"),
                      backoff=Backoff(initial_s=0.02, max_s=0.2))
    peers.start()
    async with asyncio.timeout(5):
        while not all(p.connected for p in peers.peers.values()):  # bounded by the timeout
            await asyncio.sleep(0.01)
    return Router(prefills, decode, peers)


async def run_request(routed: RoutedRequest) -> list[TokenEvent]:
    try:
        return [event async for batch in routed.events() for event in batch]
    finally:
        await routed.close()


def request(rid: str = "r1") -> GenerationRequest:
    return GenerationRequest(rid, (5, 6, 7), 50, stop_token_ids=(EOS,))


def test_wire_id_is_fresh_per_attempt() -> None:
    assert [wire_id("r", attempt) for attempt in range(3)] == ["r", "r~1", "r~2"]


def test_places_through_the_context_and_counts_into_its_stats() -> None:
    async def main():
        r = await router()
        events = await run_request(RoutedRequest(r.context(), request()))
        assert [e.token_id for e in events] == echo_script((5, 6, 7))
        # The decode node first: whether it holds the prompt decides if a prefill node is needed.
        assert r.selections == [("decode", "r1", set()), ("prefill", "r1", set())]
        assert r.load_changes == 1  # once, right after both dispatches
        assert (r.stats.requests.total, r.stats.requests.completed) == (1, 1)
        assert r.stats.active_prefills == 0 and r.stats.active_decodes == 0
        in_flight = [n["in_flight"] for role in r.peers.pool.stats(0).values() for n in role]
        assert in_flight == [0, 0, 0]
        await r.close()

    run(main())


def test_reroute_excludes_the_failed_node_up_to_the_contexts_limit() -> None:
    async def main():
        r = await router()
        r.prefills[0].drop_link_on_request = True
        events = await run_request(RoutedRequest(r.context(max_placements=2), request()))
        assert [e.token_id for e in events] == echo_script((5, 6, 7))
        assert r.selections[2:] == [("decode", "r1", {"prefill-0"}),
                                    ("prefill", "r1", {"prefill-0"})]
        assert r.stats.requests.rerouted == 1
        assert r.prefills[1].requests[0].request_id == "r1~1"
        await r.close()

        r = await router()
        r.prefills[0].drop_link_on_request = True
        events = await run_request(RoutedRequest(r.context(max_placements=1), request("r2")))
        assert len(events) == 1 and events[0].finish_reason == FINISH_ERROR
        assert len(r.selections) == 2 and r.stats.requests.rerouted == 0
        assert r.stats.requests.failed == 1
        await r.close()

    run(main())


def test_a_decode_node_holding_the_prompt_serves_it_alone() -> None:
    async def main():
        r = await router()
        prompt = tuple(range(100, 1400))  # 1,300 tokens: the index's blocks cover 1,280
        req = GenerationRequest("local", prompt, 50, stop_token_ids=(EOS,))
        pool = r.peers.pool
        pool.prefixes.record("decode-0", pool.prefixes.blocks(prompt))  # e.g. its last turn
        context = dataclasses.replace(r.context(), local_prefill_tokens=300)
        # The router trusts its index only while the node reports a non-empty prefix cache.
        blocks = pool.prefixes.blocks(prompt)
        assert pool.cached_prefix_tokens("decode-0", blocks, time.monotonic()) == 0
        r.decode.prefix_capacity_bytes = 1 << 30
        async with asyncio.timeout(5):
            while not pool.cached_prefix_tokens("decode-0", blocks, time.monotonic()):
                await asyncio.sleep(0.05)  # until its next telemetry report
        events = await run_request(RoutedRequest(context, req))
        assert [e.token_id for e in events] == echo_script(prompt)
        assert r.selections == [("decode", "local", set())]  # no prefill node chosen
        assert r.decode.local == ["local"] and not any(p.requests for p in r.prefills)
        assert r.stats.requests.local_prefills == 1
        # Missing more than the limit: a prefill node does it, as always.
        narrow = dataclasses.replace(context, local_prefill_tokens=10)
        events = await run_request(RoutedRequest(narrow, replace_id(req, "remote")))
        assert [e.token_id for e in events] == echo_script(prompt)
        assert [p.requests[0].request_id for p in r.prefills if p.requests] == ["remote"]
        await r.close()

    run(main())


def test_placing_a_request_records_its_prefix_on_both_nodes() -> None:
    async def main():
        r = await router()
        prompt = tuple(range(100, 1200))
        await run_request(RoutedRequest(r.context(), GenerationRequest("p", prompt, 5)))
        prefixes = r.peers.pool.prefixes
        blocks = prefixes.blocks(prompt)
        assert prefixes.cached_tokens("prefill-0", blocks) == 1024
        assert prefixes.cached_tokens("decode-0", blocks) == 1024
        assert prefixes.cached_tokens("prefill-1", blocks) == 0
        await r.close()

    run(main())


def replace_id(request: GenerationRequest, request_id: str) -> GenerationRequest:
    return dataclasses.replace(request, request_id=request_id)


def test_a_failed_result_reads_as_the_nodes_error() -> None:
    failed = PeerEvent("prefill", "p0", result=Result("r", 1, [], FINISH_ERROR, 1,
                                                        "handoff failed"))
    as_error = failed_result_as_error(failed)
    assert (as_error.source, as_error.node_id, as_error.error) == ("prefill", "p0",
                                                                   "handoff failed")
    assert as_error.result is None and not as_error.lost
    fine = PeerEvent("decode", "d0", result=Result("r", 2, [5], "stop", 3))
    assert failed_result_as_error(fine) is fine


def test_a_move_with_no_pair_left_waits_out_migration_wait_s_without_spinning() -> None:
    """A context with no router behind it (``wait_for_nodes`` left as is): a moving request
    that finds no healthy pair waits out ``migration_wait_s`` and then fails, asking for a
    node a bounded number of times instead of in a busy loop until the deadline."""
    from mlxcel_plugin.errors import NoHealthyNodeError

    asks: list[str] = []

    async def no_node(role: str, info: RequestInfo, excluded: Collection[str],
                      blocks: Sequence[int] = ()) -> PeerLink:
        asks.append(role)
        raise NoHealthyNodeError(f"no healthy {role} node")

    async def main():
        context = RoutingContext(select=no_node, pool=NodePool.from_peers([], []),
                                 stats=RouterStats(), on_load_change=lambda: None,
                                 max_placements=3, migration_wait_s=0.2)
        routed = RoutedRequest(context, request())
        try:
            with pytest.raises(NoHealthyNodeError):
                await routed._place_again()
        finally:
            await routed.close()

    run(main())
    assert 1 <= len(asks) <= 3, asks  # one try, then one after the wait (not thousands)
