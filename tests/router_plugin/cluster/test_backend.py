"""ClusterBackend against in-process fake prefill/decode nodes over real loopback links."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import pytest

from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest, TokenEvent
from mlxcel_plugin.errors import AtCapacityError, NoHealthyNodeError
from mlxcel_plugin.link import Backoff
from mlxcel_plugin.testing.fake_engine import FakeEngine
from mlxcel_plugin.testing.fake_peers import EOS, SECRET, FakeDecode, FakePrefill, echo_script
from router_plugin.balancers import RoundRobinBalancer
from router_plugin.cluster.admission import AdmissionController, BackpressureConfig
from router_plugin.cluster.backend import ClusterBackend, RouterConfig
from router_plugin.cluster.health import HealthConfig, HealthMonitor
from router_plugin.cluster.node_pool import NodeHealth, NodePool
from router_plugin.cluster.peer_links import PeerLinks, make_dialer
from router_plugin.cluster.stats import RouterStats
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app

pytestmark = pytest.mark.timeout(60)
FAST = Backoff(initial_s=0.02, max_s=0.2)
QUIET = HealthConfig(interval_s=60.0)  # tests probe by hand unless they ask for the monitor


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # bounded by the timeout
            await asyncio.sleep(0.01)


@dataclass
class Cluster:
    prefills: list[FakePrefill]
    decodes: list[FakeDecode]
    backend: ClusterBackend

    @property
    def stats(self) -> RouterStats:
        return self.backend.stats

    def health(self, node_id: str) -> NodeHealth:
        return self.backend.pool.health(node_id)

    async def close(self) -> None:
        await self.backend.health.close()
        await self.backend.peers.close()
        for node in (*self.prefills, *self.decodes):
            await node.stop()


async def cluster(n_prefill: int = 2, n_decode: int = 2, *, backpressure=None,
                  health=QUIET, backoff=FAST, config: RouterConfig | None = None,
                  **decode_kwargs) -> Cluster:
    decodes = [await FakeDecode(node_id=f"d{i}", **decode_kwargs).start()
               for i in range(n_decode)]
    by_address = {d.address: d for d in decodes}
    prefills = [await FakePrefill(node_id=f"p{i}", decodes=by_address).start()
                for i in range(n_prefill)]
    pool = NodePool.from_peers([p.address for p in prefills], [d.address for d in decodes])
    peers = PeerLinks(pool, make_dialer(SECRET, "router-test"), backoff=backoff)
    monitor = HealthMonitor(peers, health)
    balancers = {"prefill": RoundRobinBalancer(0), "decode": RoundRobinBalancer(1)}
    backend = ClusterBackend(peers, monitor, balancers,
                             AdmissionController(backpressure or BackpressureConfig()),
                             RouterStats(), config=config or RouterConfig())
    peers.start()
    monitor.start()
    await wait_for(lambda: all(p.connected for p in peers.peers.values()))
    return Cluster(prefills, decodes, backend)


def request(rid: str = "r1", prompt: Sequence[int] = (5, 6, 7), max_tokens: int = 50):
    return GenerationRequest(rid, tuple(prompt), max_tokens, stop_token_ids=(EOS,))


async def collect(backend: ClusterBackend, req: GenerationRequest) -> list[TokenEvent]:
    return [event async for batch in backend.stream(req) for event in batch]


def tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


# -- happy paths ----------------------------------------------------------------


def test_tokens_flow_prefill_then_decode_in_order() -> None:
    async def main():
        c = await cluster()
        events = await collect(c.backend, request())
        assert tokens(events) == echo_script((5, 6, 7))
        assert [e.index for e in events] == list(range(len(events)))
        assert events[-1].finish_reason == "stop" and events[-1].token_id == EOS
        claim = c.decodes[0].received[0]
        assert claim.header["claim"] is True and c.decodes[0].claimed == ["r1"]
        assert c.prefills[0].requests[0].decode_target == c.decodes[0].address
        assert (c.stats.requests.total, c.stats.requests.completed) == (1, 1)
        assert c.decodes[0].cancelled == [] and c.prefills[0].cancelled == []
        await c.close()

    run(main())


def test_both_pools_take_turns() -> None:
    async def main():
        c = await cluster()
        await asyncio.gather(*(collect(c.backend, request(f"r{i}")) for i in range(4)))
        counts = {e["id"]: e["dispatched"] for role in c.backend.pool.stats(0).values()
                  for e in role}
        assert counts == {"prefill-0": 2, "prefill-1": 2, "decode-0": 2, "decode-1": 2}
        assert c.stats.active_prefills == 0 and c.stats.active_decodes == 0
        await c.close()

    run(main())


def test_first_token_that_ends_the_request_cancels_the_claim() -> None:
    async def main():
        c = await cluster(1, 1)
        events = await collect(c.backend, request(max_tokens=1))
        assert len(events) == 1 and events[0].finish_reason == "length"
        await wait_for(lambda: c.decodes[0].cancelled == ["r1"])
        assert c.prefills[0].cancelled == []
        await c.close()

    run(main())


def test_max_tokens_ends_with_length() -> None:
    async def main():
        c = await cluster(1, 1)
        events = await collect(c.backend, request(max_tokens=3))
        assert len(events) == 3 and events[-1].finish_reason == "length"
        await c.close()

    run(main())


# -- faults ------------------------------------------------------------------------


def test_prefill_link_lost_before_the_first_token_reroutes() -> None:
    async def main():
        c = await cluster()
        c.prefills[0].drop_link_on_request = True
        events = await collect(c.backend, request())
        assert tokens(events) == echo_script((5, 6, 7))
        assert c.stats.requests.rerouted == 1 and c.stats.requests.completed == 1
        assert c.health("prefill-0") in (NodeHealth.UNREACHABLE, NodeHealth.HEALTHY)
        assert len(c.prefills[1].requests) == 1
        # The old attempt's claim was cancelled; the new one runs under a fresh wire id.
        assert "r1" in c.decodes[0].cancelled
        assert c.prefills[1].requests[0].request_id == "r1~1"
        await c.close()

    run(main())


def test_a_reroute_waits_for_nodes_the_router_dropped_while_it_read_late() -> None:
    """The prefill node is killed before the first token while the router has just dropped
    the only other one (as when its own loop stalls and every ping reads late): the request
    waits for that node to come back instead of answering 503."""
    async def main():
        c = await cluster(2, 1, config=RouterConfig(migration_wait_s=10.0))
        pool = c.backend.pool
        pool.mark_unreachable("prefill-1", 0.0, "silent")  # dropped, yet alive
        c.prefills[0].prefill_delay_s = 5.0  # holds the request until it is killed

        async def kill_then_revive():
            await wait_for(lambda: c.prefills[0].requests)
            await c.prefills[0].stop()
            await wait_for(lambda: c.stats.requests.rerouted == 1)
            await wait_for(lambda: c.backend._node_changes)  # the request waits for a node
            pool.mark_healthy("prefill-1", 0.0)
            c.backend.on_load_change()  # what a node coming back does

        faults = asyncio.create_task(kill_then_revive())
        events = await collect(c.backend, request())
        await faults
        assert tokens(events) == echo_script((5, 6, 7))
        assert c.stats.requests.rerouted == 1 and c.stats.requests.completed == 1
        assert len(c.prefills[1].requests) == 1
        await c.close()

    run(main())


def test_prefill_at_capacity_tries_another_node_then_503() -> None:
    async def main():
        c = await cluster()
        c.prefills[0].error_code = "at_capacity"
        events = await collect(c.backend, request("a"))
        assert tokens(events) == echo_script((5, 6, 7))
        c1 = await cluster(1, 1)
        c1.prefills[0].error_code = "at_capacity"
        with pytest.raises(AtCapacityError):
            await collect(c1.backend, request("b"))
        assert c1.stats.requests.rejected == 1
        await c.close()
        await c1.close()

    run(main())


def test_prefill_engine_error_ends_with_one_error_event() -> None:
    async def main():
        c = await cluster(1, 1)
        c.prefills[0].error_code = "engine_error"
        events = await collect(c.backend, request())
        assert len(events) == 1 and events[0].finish_reason == FINISH_ERROR
        assert "engine_error" in events[0].error
        await wait_for(lambda: c.decodes[0].cancelled == ["r1"])
        assert c.stats.requests.failed == 1
        await c.close()

    run(main())


COUNT_TO = 180  # 79 tokens for prompt (100,): 1.6 s at 20 ms each, faults land mid-stream


def counting(prompt: Sequence[int]) -> list[int]:
    """Each token one above the one before, below COUNT_TO: a prompt ending in ``k``
    continues."""
    return list(range(prompt[-1] + 1, COUNT_TO))


COUNTED = list(range(101, COUNT_TO))  # what prompt (100,) gets with no fault


async def stream_until(stream, count: int) -> list[TokenEvent]:
    got: list[TokenEvent] = []
    while len(tokens(got)) < count:  # bounded: the stream ends after len(COUNTED) tokens
        got += await anext(stream)
    return got


def test_decode_lost_mid_stream_migrates_with_no_gap_and_no_duplicate() -> None:
    async def main():
        c = await cluster(1, 2, token_delay_s=0.02)
        c.prefills[0].script = counting
        doomed = c.backend.stream(request("doomed", prompt=(100,), max_tokens=300))
        got = await stream_until(doomed, 3)
        await c.decodes[0].stop()
        got += [event async for batch in doomed for event in batch]
        assert tokens(got) == COUNTED  # what the client would have got with no fault
        assert [e.index for e in got] == list(range(len(got)))
        assert sum(e.finish_reason is not None for e in got) == 1
        assert got[-1].finish_reason == "stop"
        moved = c.prefills[0].requests[-1]
        streamed = len(moved.prompt_token_ids) - 1
        assert moved.request_id == "doomed~1" and streamed >= 3
        assert moved.prompt_token_ids == [100, *COUNTED[:streamed]]
        assert moved.max_tokens == 300 - streamed
        assert moved.decode_target == c.decodes[1].address
        assert (c.stats.requests.migrated, c.stats.requests.failed) == (1, 0)
        assert c.stats.requests.completed == 1
        assert c.backend.pool.stats(0)["decode"][1]["in_flight"] == 0
        await c.close()

    run(main())


def test_no_healthy_pair_left_ends_with_one_error_event() -> None:
    async def main():
        for config in (RouterConfig(), RouterConfig(max_migrations=0)):
            c = await cluster(1, 1, token_delay_s=0.02, config=config)
            c.prefills[0].script = counting
            doomed = c.backend.stream(request("doomed", prompt=(100,), max_tokens=300))
            got = await stream_until(doomed, 3)
            await c.decodes[0].stop()
            rest = [event async for batch in doomed for event in batch]
            assert tokens(got) == COUNTED[:len(tokens(got))] and tokens(rest) == []
            assert len(rest) == 1 and rest[0].finish_reason == FINISH_ERROR
            assert rest[0].token_id is None
            assert c.stats.requests.failed == 1
            assert c.stats.requests.migrated == (1 if config.max_migrations else 0)
            assert c.health("decode-0") is NodeHealth.UNREACHABLE
            await c.close()

    run(main())


def test_a_silent_decode_node_is_cancelled_and_the_request_migrates() -> None:
    async def main():
        c = await cluster(1, 2, token_delay_s=0.02,
                          config=RouterConfig(token_timeout_s=0.3))
        c.prefills[0].script = counting
        stream = c.backend.stream(request("slow", prompt=(100,), max_tokens=300))
        got = await stream_until(stream, 3)
        c.decodes[0].token_delay_s = 30.0  # its next token never comes in time
        got += [event async for batch in stream for event in batch]
        assert tokens(got) == COUNTED and got[-1].finish_reason == "stop"
        assert "slow" in c.decodes[0].cancelled  # the stalled node frees its work
        assert c.stats.requests.migrated == 1
        assert c.stats.migration_resumes == 1 and c.stats.migration_resume_s[0] >= 0
        await c.close()

    run(main())


def test_closing_the_stream_cancels_both_sides() -> None:
    async def main():
        c = await cluster(1, 1, token_delay_s=0.02)
        c.prefills[0].script = lambda prompt: [100 + i for i in range(200)]
        stream = c.backend.stream(request(max_tokens=300))
        await anext(stream)
        await anext(stream)
        await stream.aclose()
        await wait_for(lambda: c.decodes[0].cancelled == ["r1"])
        assert c.stats.requests.closed_early == 1
        assert c.backend.pool.stats(0)["decode"][0]["in_flight"] == 0
        # Before the first token the prefill node hears it too.
        c.prefills[0].prefill_delay_s = 0.5
        stream = c.backend.stream(request("r2"))
        task = asyncio.create_task(anext(stream))
        await wait_for(lambda: len(c.prefills[0].requests) == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        await wait_for(lambda: c.prefills[0].cancelled == ["r2"])
        await wait_for(lambda: "r2" in c.decodes[0].cancelled)
        await c.close()

    run(main())


def test_no_healthy_prefill_reprobes_once_then_503_and_recovers() -> None:
    async def main():
        # Redials only when woken: the re-probe is what brings the node back.
        c = await cluster(1, 1, backoff=Backoff(initial_s=30.0, max_s=30.0))
        await c.prefills[0].stop()
        await wait_for(lambda: c.health("prefill-0") is NodeHealth.UNREACHABLE)
        results = await asyncio.gather(*(collect(c.backend, request(f"r{i}")) for i in range(5)),
                                       return_exceptions=True)
        assert all(isinstance(r, NoHealthyNodeError) for r in results)
        assert c.backend.health.reprobes == 1  # single flight for the whole burst
        await c.prefills[0].start()  # same port
        await asyncio.sleep(0.3)  # past the gate's minimum interval
        events = await collect(c.backend, request("back"))  # the re-probe reconnects it
        assert tokens(events) == echo_script((5, 6, 7))
        assert c.backend.health.reprobes == 2
        await c.close()

    run(main())


def test_health_monitor_brings_a_restarted_node_back() -> None:
    async def main():
        c = await cluster(1, 1, health=HealthConfig(interval_s=0.1))
        await c.prefills[0].stop()
        await wait_for(lambda: c.health("prefill-0") is NodeHealth.UNREACHABLE)
        await c.prefills[0].start()
        await wait_for(lambda: c.health("prefill-0") is NodeHealth.HEALTHY)
        assert c.backend.is_ready()
        await c.close()

    run(main())


# -- admission -------------------------------------------------------------------


def test_admission_rejects_and_queues() -> None:
    async def main():
        reject_all = BackpressureConfig(moderate_utilization=0.01, high_utilization=0.01,
                                        critical_utilization=0.01, node_capacity_requests=1)
        c = await cluster(1, 1, backpressure=reject_all, token_delay_s=0.05)
        c.prefills[0].script = lambda prompt: [100 + i for i in range(10)]
        busy = asyncio.create_task(collect(c.backend, request("busy")))
        await wait_for(lambda: c.stats.active_decodes == 1)
        with pytest.raises(AtCapacityError):
            await collect(c.backend, request("refused"))
        assert c.stats.requests.rejected == 1
        await busy
        await c.close()

        queue_all = BackpressureConfig(moderate_utilization=0.5, high_utilization=0.5,
                                       critical_utilization=1.0, node_capacity_requests=1,
                                       high_action="queue", critical_action="queue")
        c = await cluster(1, 1, backpressure=queue_all, token_delay_s=0.02)
        c.prefills[0].script = lambda prompt: [100 + i for i in range(10)]
        results = await asyncio.gather(*(collect(c.backend, request(f"q{i}")) for i in range(3)))
        assert all(len(tokens(r)) == 10 for r in results)
        assert c.stats.requests.queued >= 1 and c.stats.requests.rejected == 0
        await c.close()

    run(main())


# -- through the HTTP front: same bytes as a single node --------------------------


def test_router_bodies_match_a_single_node(text_tokenizer) -> None:
    reply = text_tokenizer.encode("Hello there, fox!", add_special_tokens=False) + [EOS]

    def script(prompt) -> list[int]:
        return list(reply)

    def normalize(text: str) -> str:
        out = []
        for line in text.split("\n"):
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                obj.pop("id", None), obj.pop("created", None)
                line = "data: " + json.dumps(obj)
            out.append(line)
        return "\n".join(out)

    async def bodies(app) -> list[str]:
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                     base_url="http://t") as client:
            for stream in (False, True):
                r = await client.post("/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": stream, "max_tokens": 20})
                assert r.status_code == 200, r.text
                out.append(normalize(r.text) if stream else json.dumps(
                    {k: v for k, v in r.json().items() if k not in ("id", "created")}))
        return out

    async def main():
        c = await cluster(1, 1)
        c.prefills[0].script = script
        routed = await bodies(make_app(c.backend, text_tokenizer, "m"))
        engine = FakeEngine.scripted(lambda req: list(reply),
                                     eos_token_ids=text_tokenizer.eos_token_ids)
        engine.start()
        try:
            single = await bodies(make_app(LocalEngineBackend(engine), text_tokenizer, "m"))
        finally:
            engine.close()
        assert routed == single
        await c.close()

    run(main())


def test_a_migration_may_return_to_a_node_it_excluded_when_no_other_pair_is_left() -> None:
    async def main():
        c = await cluster(1, 1, token_delay_s=0.02,
                          config=RouterConfig(token_timeout_s=0.3))
        c.prefills[0].script = counting
        stream = c.backend.stream(request("slow", prompt=(100,), max_tokens=300))
        got = await stream_until(stream, 3)
        c.decodes[0].token_delay_s = 30.0  # stalls: excluded, yet the only decode node
        task = asyncio.create_task(collect_rest(stream))
        await wait_for(lambda: c.stats.requests.migrated == 1)
        # The second attempt must be streaming (asleep on the 30 s delay) before the reset.
        await wait_for(lambda: "slow~1" in c.decodes[0].streams)
        await asyncio.sleep(0.01)
        c.decodes[0].token_delay_s = 0.02  # the attempt after the next one streams again
        got += await task
        assert tokens(got) == COUNTED and got[-1].finish_reason == "stop"
        assert c.stats.requests.migrated == 2 and c.stats.requests.failed == 0
        assert c.decodes[0].claimed == ["slow", "slow~1", "slow~2"]
        await c.close()

    run(main())


async def collect_rest(stream) -> list[TokenEvent]:
    return [event async for batch in stream for event in batch]
