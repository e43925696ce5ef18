"""Membership: snapshots become joins, drains, leaves and refusals (no sockets)."""

from __future__ import annotations

import asyncio
import logging

from mlxcel_plugin.discovery_api import Member
from mlxcel_plugin.nodes.decode_allowlist import DecodeAllowlist
from router_plugin.cluster.node_pool import NodeHealth, NodePool
from router_plugin.cluster.peer_links import PeerLink, PeerLinks
from router_plugin.discovery.membership import Membership, with_membership
from router_plugin.discovery.wiring import MembershipCollector

A, B = "10.0.0.1:9000", "10.0.0.2:9000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def never_connects(address: str, role: str):
    await asyncio.Event().wait()


def make_membership(pool: NodePool | None = None, **kwargs) -> Membership:
    pool = pool or NodePool()
    peers = PeerLinks(pool, never_connects)

    def make_peer(node_id: str) -> PeerLink:
        return PeerLink(node_id, pool.role(node_id), pool.address(node_id), never_connects, pool)

    kwargs.setdefault("fingerprint", "aaaa")
    return Membership(peers, make_peer, clock=kwargs.pop("clock", Clock()), **kwargs)


def snapshot(*members: tuple[str, str], fingerprint: str | None = None, source: str = "file"):
    return frozenset(Member(role, address, fingerprint, source) for role, address in members)


def run(body):
    async def scenario():
        membership = await body()
        await membership.peers.close()

    asyncio.run(scenario())


def test_a_new_member_joins_with_a_fresh_id_and_a_dialing_link():
    async def body():
        membership = make_membership()
        membership.update("file", snapshot(("decode", A)))
        assert membership.pool.ids("decode") == ["decode-0"]
        assert membership.pool.health("decode-0") is NodeHealth.UNKNOWN  # healthy once dialled
        assert "decode-0" in membership.peers.peers
        assert membership.counts[("decode", "joined")] == 1
        membership.update("file", snapshot(("decode", A)))  # the same snapshot: nothing new
        assert membership.pool.ids("decode") == ["decode-0"]
        return membership

    run(body)


def test_a_member_that_left_drains_until_its_requests_finish_then_leaves():
    async def body():
        clock = Clock()
        membership = make_membership(clock=clock)
        membership.update("file", snapshot(("decode", A), ("decode", B)))
        membership.pool.on_dispatch("decode-1")
        membership.update("file", snapshot(("decode", A)))
        assert membership.pool.health("decode-1") is NodeHealth.DRAINING
        await membership.finish_drains()
        assert "decode-1" in membership.pool.ids()  # one request still in flight
        membership.pool.on_finish("decode-1")
        await membership.finish_drains()
        assert membership.pool.ids("decode") == ["decode-0"]
        assert "decode-1" not in membership.peers.peers
        assert [c.change for c in membership.recent] == ["joined", "joined", "draining", "left"]
        return membership

    run(body)


def test_a_drain_ends_at_the_timeout_even_with_requests_in_flight():
    async def body():
        clock = Clock()
        membership = make_membership(clock=clock, drain_timeout_s=10)
        membership.update("file", snapshot(("decode", A)))
        membership.pool.on_dispatch("decode-0")
        membership.update("file", snapshot())
        clock.now += 11
        await membership.finish_drains()
        assert membership.pool.ids() == []
        assert membership.recent[-1].reason == "drain timed out with 1 in flight"
        return membership

    run(body)


def test_a_draining_member_listed_again_serves_again():
    async def body():
        membership = make_membership()
        membership.update("file", snapshot(("decode", A)))
        membership.pool.on_dispatch("decode-0")
        membership.update("file", snapshot())
        membership.update("file", snapshot(("decode", A)))
        assert membership.pool.health("decode-0") is NodeHealth.UNKNOWN  # not connected yet
        await membership.finish_drains()
        assert membership.pool.ids() == ["decode-0"]
        return membership

    run(body)


def test_another_models_fingerprint_is_refused_with_one_log_line(caplog):
    async def body():
        membership = make_membership(fingerprint="aaaa")
        with caplog.at_level(logging.WARNING, "router_plugin.discovery.membership"):
            for _ in range(3):  # every poll lists it again: still one line
                membership.update("file", snapshot(("decode", A), fingerprint="bbbb"))
        assert membership.pool.ids() == []
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ["discovery (file): refusing decode node 10.0.0.1:9000: model "
                         "fingerprint bbbb differs from the pool's aaaa"]
        assert membership.counts[("decode", "refused")] == 1
        membership.update("file", snapshot(("decode", A), fingerprint="aaaa"))
        assert membership.pool.ids() == ["decode-0"]  # the same model: it joins
        return membership

    run(body)


def test_a_member_without_a_fingerprint_is_trusted_to_the_handshake():
    async def body():
        membership = make_membership(fingerprint="aaaa")
        membership.update("dns", snapshot(("decode", A)))
        assert membership.pool.ids() == ["decode-0"]
        return membership

    run(body)


def test_a_decode_node_outside_the_allowlist_is_refused():
    async def body():
        allowlist = DecodeAllowlist.from_env({"MLXCEL_DECODE_ALLOWLIST": A})
        membership = make_membership(allowlist=allowlist)
        membership.update("dns", snapshot(("decode", A), ("decode", B), ("prefill", B)))
        assert sorted(membership.pool.address(i) for i in membership.pool.ids("decode")) == [A]
        assert membership.pool.ids("prefill") == ["prefill-0"]  # the list is for decode targets
        refused = [c for c in membership.recent if c.change == "refused"]
        assert [c.reason for c in refused] == ["not in MLXCEL_DECODE_ALLOWLIST"]
        return membership

    run(body)


def test_static_peers_are_members_and_only_drain_once_every_source_reported():
    async def body():
        pool = NodePool.from_peers([A], [B, "dns:decode.svc:9000"])
        assert pool.ids() == ["prefill-0", "decode-0"]  # dns: entries are the dns source's
        membership = make_membership(pool)
        membership.expect(["static", "dns"])
        membership.update("dns", snapshot())  # static has not reported yet
        assert pool.health("decode-0") is NodeHealth.UNKNOWN
        membership.update("static", snapshot(("prefill", A), ("decode", B), source="static"))
        membership.update("dns", snapshot())
        assert pool.health("decode-0") is NodeHealth.UNKNOWN  # static still lists it
        return membership

    run(body)


def test_stats_and_metrics_show_membership_changes():
    async def body():
        membership = make_membership()
        membership.expect(["file"])
        membership.update("file", snapshot(("decode", A), ("prefill", B)))
        membership.update("file", snapshot(("prefill", B)))
        stats = with_membership(lambda: {"nodes": {}}, membership)()
        assert stats["membership"]["sources"] == ["file"]
        assert stats["membership"]["draining"] == ["decode-0"]
        assert stats["membership"]["changes"] == {"decode_draining": 1, "decode_joined": 1,
                                                  "prefill_joined": 1}
        assert A not in str(stats)  # ids, never addresses
        families = {f.name: f for f in MembershipCollector(membership).collect()}
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in families.values() for s in family.samples}
        assert samples[("mlxcel:router_pool_nodes", (("role", "decode"),
                                                     ("state", "draining")))] == 1
        assert samples[("mlxcel:router_membership_changes_total",
                        (("change", "joined"), ("role", "prefill")))] == 1
        return membership

    run(body)
