"""A refused handoff never reaches the client while a compatible pair remains.

In-process fake nodes over real loopback links, the real ``ClusterBackend``:
decode node ``d0`` refuses the next handoff with one code, as a real decode
node does in its KV_ACK; the fake prefill node then reports it to the router as
the real one does (its first token, then an ERROR frame with that code). The
request must complete on ``d1``, counted as rerouted under that code, with the
pair (prefill, ``d0``) cooling down.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

import mlxcel_plugin.kv_codecs.base  # noqa: F401  (its refusals join the hierarchy)
import mlxcel_plugin.kv_serde.errors  # noqa: F401
from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest, TokenEvent
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.link import Backoff, serve_links
from mlxcel_plugin.link.protocol.frames import ErrorFrame, Result
from mlxcel_plugin.testing.fake_peers import EOS, SECRET, FakeDecode, FakePrefill
from router_plugin.balancers import RoundRobinBalancer
from router_plugin.cluster.admission import AdmissionController, BackpressureConfig
from router_plugin.cluster.backend import ClusterBackend, RouterConfig
from router_plugin.cluster.health import HealthConfig, HealthMonitor
from router_plugin.cluster.node_pool import NodePool
from router_plugin.cluster.peer_links import PeerLinks, make_dialer
from router_plugin.cluster.stats import RouterCollector, RouterStats

pytestmark = pytest.mark.timeout(120)

# What else a prefill node reports when its KV did not land (besides the receiver's codes).
NODE_CODES = ("at_capacity", "unknown_request", "transfer_timeout", "decode_node_lost",
              "handoff_failed", "duplicate_request")


def refusal_codes() -> list[str]:
    """Every code a decode node's refusal can carry: the whole HandoffError hierarchy."""
    codes, todo = set(NODE_CODES), [HandoffError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.code:
            codes.add(cls.code)
    return sorted(codes)


@dataclass
class RefusingDecode(FakeDecode):
    refuse_with: list[str] = field(default_factory=list)  # one code per next handoff


@dataclass
class ReportingPrefill(FakePrefill):
    """Reports a refused handoff the way ``PrefillNode`` does: seq 0, then ERROR(code)."""

    async def _prefill(self, link, request) -> None:
        decode = self.decodes[request.decode_target]
        if not decode.refuse_with:
            await super()._prefill(link, request)
            return
        code = decode.refuse_with.pop(0)
        first = self.script(request.prompt_token_ids)[0]
        await link.send(Result(request.request_id, 0, [first], None, 1).to_frame())
        await link.send(ErrorFrame(code, f"KV handoff to {decode.node_id} failed: {code}",
                                   request.request_id).to_frame())


def script(prompt) -> list[int]:
    return [100 + (sum(prompt) + i) % 50 for i in range(4)] + [EOS]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


async def start_cluster(n_decode: int = 2, config: RouterConfig | None = None):
    decodes = [await RefusingDecode(node_id=f"d{i}").start() for i in range(n_decode)]
    prefill = await ReportingPrefill(node_id="p0", script=script,
                                     decodes={d.address: d for d in decodes}).start()
    pool = NodePool.from_peers([prefill.address], [d.address for d in decodes])
    peers = PeerLinks(pool, make_dialer(SECRET, "router-test"),
                      backoff=Backoff(initial_s=0.02, max_s=0.2))
    balancers = {"prefill": RoundRobinBalancer(0), "decode": RoundRobinBalancer(0)}
    backend = ClusterBackend(peers, HealthMonitor(peers, HealthConfig(interval_s=60.0)),
                             balancers, AdmissionController(BackpressureConfig()),
                             RouterStats(), config=config or RouterConfig())
    peers.start()
    async with asyncio.timeout(10):
        while not all(p.connected for p in peers.peers.values()):  # bounded by the timeout
            await asyncio.sleep(0.01)
    return prefill, decodes, backend


async def stop(prefill, decodes, backend) -> None:
    await backend.peers.close()
    for node in (prefill, *decodes):
        await node.stop()


async def generate(backend: ClusterBackend, rid: str) -> list[TokenEvent]:
    request = GenerationRequest(rid, (5, 6, 7), 50, stop_token_ids=(EOS,))
    return [e async for batch in backend.stream(request) for e in batch]


def test_every_refusal_code_is_rerouted_to_the_compatible_decode_node() -> None:
    codes = refusal_codes()
    assert {"handoff_layer_count_mismatch", "handoff_stale_epoch", "prefix_missing",
            "handoff_adopt_failed", "handoff_oversize", "at_capacity"} <= set(codes)

    async def main():
        prefill, decodes, backend = await start_cluster()
        for i, code in enumerate(codes):
            decodes[0].refuse_with.append(code)
            # Round robin would pick d1 every other time: point it at d0 each round.
            backend.balancers["decode"] = RoundRobinBalancer(0)
            events = await generate(backend, f"r{i}")
            assert events[-1].finish_reason == "stop", (code, events[-1])
            assert all(e.error is None for e in events), code
            assert backend.stats.refused_handoffs[code] == 1, code
            backend.pool.pairing.succeeded("prefill-0", "decode-0")  # next code, fresh pair
        stats = backend.stats
        assert stats.requests.rerouted == len(codes)
        assert (stats.requests.completed, stats.requests.failed) == (len(codes), 0)
        metrics = {s.labels.get("code"): s.value for family in
                   RouterCollector(stats, backend.pool, lambda: 0).collect()
                   if family.name == "mlxcel:router_refused_handoffs" for s in family.samples
                   if s.name.endswith("_total")}
        assert metrics == dict.fromkeys(codes, 1.0)
        await stop(prefill, decodes, backend)

    run(main())


def test_the_refusing_pair_cools_down_and_takes_no_next_request() -> None:
    async def main():
        prefill, decodes, backend = await start_cluster()
        decodes[0].refuse_with.append("handoff_oversize")
        await generate(backend, "first")
        assert backend.pool.pairing.cooling("prefill-0", "decode-0", backend.clock())
        claimed_before = list(decodes[0].claimed)
        for i in range(4):  # round robin alone would send two of them to d0
            events = await generate(backend, f"next{i}")
            assert events[-1].finish_reason == "stop"
        assert decodes[0].claimed == claimed_before
        await stop(prefill, decodes, backend)

    run(main())


def test_with_no_other_pair_the_client_gets_one_clean_error_naming_the_cause() -> None:
    async def main():
        prefill, decodes, backend = await start_cluster(
            n_decode=1, config=RouterConfig(max_migrations=2))
        decodes[0].refuse_with += ["handoff_layer_count_mismatch"] * 3
        events = await generate(backend, "doomed")
        errors = [e for e in events if e.finish_reason == FINISH_ERROR]
        assert len(errors) == 1 and events[-1] is errors[0]
        assert "handoff_layer_count_mismatch" in errors[0].error
        assert backend.stats.requests.failed == 1
        await stop(prefill, decodes, backend)

    run(main())


def test_an_announced_profile_is_kept_for_pairing() -> None:
    """The verdict's profile reaches the pool (the links read it on every connect)."""
    from mlxcel_plugin.compatibility import KVProfile, NodeProfile

    profile = NodeProfile(KVProfile("fake", 4, 2, 8, "float32", ("KVCache",)), "tok", "tpl")

    async def main():
        server = await serve_links("127.0.0.1:0", SECRET, "decode", "d", {"router"},
                                   lambda link: link.wait_closed(),
                                   announce=profile.to_announce())
        pool = NodePool.from_peers([], [server.address])
        peers = PeerLinks(pool, make_dialer(SECRET, "router-test"))
        peers.start()
        async with asyncio.timeout(10):
            while "decode-0" not in pool.pairing.profiles:  # bounded by the timeout
                await asyncio.sleep(0.01)
        assert pool.pairing.profiles["decode-0"] == profile
        assert pool.stats(0.0)["decode"][0]["kv"] == "fake 4L 2x8 float32 KVCache"
        await peers.close()
        await server.close()

    run(main())
