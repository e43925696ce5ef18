"""Prefill and decode nodes as real processes on 127.0.0.1, driven over real links.

The MLX tests compare against the engine's single-process ``generate`` (the
hybrid path) on the tiny checkpoint; the fault tests use the ``fake`` engine
to stay fast. ``LinkDriver`` plays the router.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxcel_plugin import openblas
from mlxcel_plugin.engine_api import CacheState, GenerationRequest, SamplingParams
from mlxcel_plugin.kv_serde import AckHeader, HandoffHeader, ModelFingerprint
from mlxcel_plugin.kv_serde.header import SerializableSamplingState
from mlxcel_plugin.kv_serde.versions import LARGE_CHUNK_SERDE_VERSION
from mlxcel_plugin.link import (
    ClusterSecret,
    Link,
    dial_link,
    generate_secret_file,
    load_cluster_secret,
)
from mlxcel_plugin.link.protocol.frames import Frame, FrameType, Request
from mlxcel_plugin.local_cluster import LOOPBACK, NodeProcess, free_port, start_node
from mlxcel_plugin.nodes.kv_wire import message_to_frame
from mlxcel_plugin.testing.fake_engine import (
    EOS_TRIGGER_TOKEN_ID,
    FakeEngine,
    FakeEngineSettings,
    expected_tokens,
    make_layer,
)
from mlxcel_plugin.testing.link_driver import LinkDriver
from mlxcel_plugin.transfer import FullTransfer, plan_transfer

REPO = Path(__file__).resolve().parents[2]
PROMPT_LENGTHS = (1, 255, 256, 257, 2040)
TRANSFERS = [(s, c) for s in ("full", "streamed", "layer-parallel") for c in ("none", "lz4")]
FAULT_TIMEOUT_S = 2.0


# ------------------------------------------------------------------ processes


class Nodes:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.secret_path = workdir / "cluster.secret"
        generate_secret_file(self.secret_path)
        self.secret: ClusterSecret = load_cluster_secret(str(self.secret_path), {})
        self.started: list[NodeProcess] = []

    def start(self, role: str, name: str, args: list[str], toml: str = "", *,
              bind: str | None = None, env: dict[str, str] | None = None) -> NodeProcess:
        config = self.workdir / f"{name}.toml"
        config.write_text(toml)
        common = ["--cluster-secret-file", str(self.secret_path), "--no-warmup",
                  "--distributed-config", str(config), "--node-id", name]
        node = start_node(role, self.workdir, common + args, name=name, env=env,
                          serving_bind=bind or f"{LOOPBACK}:{free_port()}")
        self.started.append(node)
        return node

    def wait_all(self, timeout_s: float = 120.0) -> None:
        for node in self.started:
            node.wait_healthy(timeout_s)

    def stop_all(self) -> None:
        for node in reversed(self.started):
            node.stop()


def health(node: NodeProcess) -> dict:
    with urllib.request.urlopen(f"{node.url}/health", timeout=5) as response:
        return json.loads(response.read())


async def health_when(node: NodeProcess, holds, timeout_s: float = FAULT_TIMEOUT_S) -> dict:
    """Poll /health until ``holds(state)`` (or the timeout); the last state read."""
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by the deadline
        state = health(node)
        if holds(state) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.02)


def metrics(node: NodeProcess) -> str:
    with urllib.request.urlopen(f"{node.url}/metrics", timeout=5) as response:
        return response.read().decode()


def wait_baseline(node: NodeProcess, timeout_s: float = 10.0) -> dict:
    """Poll /health until the node holds no KV and no request (its prefix cache aside)."""
    keys = ("kv_bytes", "engine_kv_bytes", "ingest_bytes", "claims", "ingesting", "ready",
            "active", "jobs")
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by the deadline
        state = health(node)
        state["engine_kv_bytes"] -= state["prefix_cache_bytes"]  # kept across requests by design
        busy = {k: state[k] for k in keys if state.get(k)}
        if not busy:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{node.role} did not return to baseline: {busy}")
        time.sleep(0.1)


def driver(nodes: Nodes, prefill: NodeProcess, decode: NodeProcess) -> LinkDriver:
    return LinkDriver(nodes.secret, prefill.serving_bind, decode.serving_bind)


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------ MLX cluster


@pytest.fixture(scope="module")
def mlx_nodes(tmp_path_factory, tiny_model_path) -> Iterator[dict]:
    nodes = Nodes(tmp_path_factory.mktemp("mlx-nodes"))
    model = ["--model", str(tiny_model_path)]
    decode = nodes.start("decode", "decode-mlx", model)
    prefills = {}
    for strategy, codec in TRANSFERS:
        toml = (f'[transfer]\nstrategy = "{strategy}"\ncodec = "{codec}"\nparallelism = 2\n'
                "chunk_bytes = 65536\n")
        prefills[(strategy, codec)] = nodes.start("prefill", f"prefill-{strategy}-{codec}",
                                                  model, toml)
    prefills[("full", "int8")] = nodes.start("prefill", "prefill-full-int8", model,
                                             '[transfer]\nstrategy = "full"\ncodec = "int8"\n'
                                             "allow_lossy = true\nchunk_bytes = 65536\n")
    try:
        nodes.wait_all()
        yield {"nodes": nodes, "decode": decode, "prefills": prefills}
    finally:
        nodes.stop_all()


def reference(model: Path, requests: list[dict]) -> dict[str, list[int]]:
    env = openblas.preload_env(os.environ) or dict(os.environ)
    done = subprocess.run([sys.executable, "-m", "tests.integration.hybrid_reference",
                           str(model)], input=json.dumps(requests), capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 * salt) % 5000 + 100 for i in range(length)]


@pytest.fixture(scope="module")
def expected(tiny_model_path) -> dict[str, list[int]]:
    requests = [{"request_id": f"len{n}", "prompt": prompt_of(n), "max_tokens": 6}
                for n in PROMPT_LENGTHS]
    requests.append({"request_id": "seeded", "prompt": prompt_of(300, 1), "max_tokens": 12,
                     "sampling": {"temperature": 0.9, "top_p": 0.9, "seed": 1234}})
    requests += [{"request_id": f"mix{i}", "prompt": prompt_of(1 + 97 * i, i), "max_tokens": 5}
                 for i in range(16)]
    requests += [{"request_id": "turn1", "prompt": TURN1, "max_tokens": 4},
                 {"request_id": "turn2", "prompt": TURN2, "max_tokens": 6}]
    return reference(tiny_model_path, requests)


@pytest.mark.parametrize(("strategy", "codec"), TRANSFERS)
def test_greedy_output_matches_hybrid(mlx_nodes, expected, strategy, codec):
    prefill, decode = mlx_nodes["prefills"][(strategy, codec)], mlx_nodes["decode"]

    async def go() -> dict[str, list[int]]:
        async with driver(mlx_nodes["nodes"], prefill, decode) as link_driver:
            got = {}
            for n in PROMPT_LENGTHS:
                outcome = await link_driver.generate(f"len{n}", prompt_of(n), 6)
                assert outcome.ok, outcome
                got[f"len{n}"] = outcome.tokens
            return got

    got = run(go())
    assert got == {f"len{n}": expected[f"len{n}"] for n in PROMPT_LENGTHS}
    # The configured strategy and codec are what went over the wire, and say so; raw bodies
    # went without crc32s (serde v4, which the decode node announced: AES-GCM authenticates
    # them), other codecs with their digest; chunks up to 32 MiB (v5, announced too).
    last_choice = health(prefill)["transfer"]["last_choice"]
    assert last_choice["codec"] == codec
    assert last_choice["checksum_of"] == ("none" if codec == "none" else "held")
    assert last_choice["serde_version"] == (LARGE_CHUNK_SERDE_VERSION if codec == "none" else 1)
    chosen = f'mlxcel:handoff_choices_total{{codec="{codec}",strategy="{strategy}"}}'
    assert chosen in metrics(prefill)
    # Streaming strategies send each prefill cell's rows after its forward, before the layer.
    ahead = [line for line in metrics(prefill).splitlines()
             if line.startswith("mlxcel:handoff_chunks_ahead_total ")]
    assert (float(ahead[0].split()[-1]) > 0) == (strategy != "full"), ahead


def test_int8_handoffs_checksum_their_bodies_once_the_decode_node_announced_it(mlx_nodes):
    """The prefill node learns the decode node's verdict (its serde versions among it) before
    the first prefill (nodes/decode_targets.py), so every int8 handoff checksums its bodies as
    sent; the first format is kept only towards a node that did not announce v3 (unit tests)."""
    prefill = mlx_nodes["prefills"][("full", "int8")]

    async def one(request_id: str) -> dict:
        async with driver(mlx_nodes["nodes"], prefill, mlx_nodes["decode"]) as link_driver:
            outcome = await link_driver.generate(request_id, prompt_of(700, 3), 6)
        assert outcome.ok and len(outcome.tokens) == 6, outcome
        return health(prefill)["transfer"]["last_choice"]

    first, second = run(one("int8-1")), run(one("int8-2"))
    assert (first["codec"], first["checksum_of"]) == ("int8", "encoded")
    assert (second["codec"], second["checksum_of"]) == ("int8", "encoded")
    assert 'mlxcel:handoff_choices_total{codec="int8",strategy="full"} 2.0' in metrics(prefill)


def test_seeded_sampling_matches_hybrid(mlx_nodes, expected):
    prefill = mlx_nodes["prefills"][("streamed", "none")]
    sampling = {"temperature": 0.9, "top_p": 0.9, "seed": 1234}

    async def go():
        async with driver(mlx_nodes["nodes"], prefill, mlx_nodes["decode"]) as link_driver:
            return await link_driver.generate("seeded", prompt_of(300, 1), 12, sampling)

    assert run(go()).tokens == expected["seeded"]


TURN1 = prompt_of(1100, 5)
TURN2 = TURN1 + prompt_of(90, 6)  # the next turn: two full 512-token chunks are cached


def test_the_decode_node_prefills_a_mostly_cached_prompt_itself(mlx_nodes, expected):
    prefill, decode = mlx_nodes["prefills"][("full", "none")], mlx_nodes["decode"]

    async def go():
        async with driver(mlx_nodes["nodes"], prefill, decode) as link_driver:
            first = await link_driver.generate("turn1", TURN1, 4)  # handed off: D keeps it
            hits_before = prefix_hits(decode)
            second = await link_driver.generate_local("turn2", TURN2, 6)
            cold = await link_driver.generate_local("cold257", prompt_of(257), 6)
            return first, second, cold, hits_before

    first, second, cold, hits_before = run(go())
    assert first.tokens == expected["turn1"]
    assert second.ok and second.tokens == expected["turn2"]  # exact, no prefill node
    assert prefix_hits(decode) - hits_before >= 1024
    assert cold.tokens == expected["len257"]  # nothing cached: it just prefills


def prefix_hits(node: NodeProcess) -> float:
    for line in metrics(node).splitlines():
        if line.startswith("mlxcel:prefix_cache_hit_tokens_total "):
            return float(line.split()[-1])
    raise AssertionError("no prefix cache counter on /metrics")


def test_sixteen_concurrent_requests_and_memory_returns_to_baseline(mlx_nodes, expected):
    prefill = mlx_nodes["prefills"][("streamed", "lz4")]

    async def go():
        async with driver(mlx_nodes["nodes"], prefill, mlx_nodes["decode"]) as link_driver:
            collectors = [await link_driver.submit(f"mix{i}", prompt_of(1 + 97 * i, i), 5)
                          for i in range(16)]
            return await asyncio.gather(*(link_driver.wait(c) for c in collectors))

    outcomes = run(go())
    assert {o.request_id: o.tokens for o in outcomes} == {
        f"mix{i}": expected[f"mix{i}"] for i in range(16)}
    wait_baseline(mlx_nodes["decode"])
    wait_baseline(prefill)
    text = metrics(mlx_nodes["decode"])
    assert "mlxcel:time_per_output_token_seconds_count" in text
    assert "mlxcel:handoff_time_seconds_count" in metrics(prefill)


# ------------------------------------------------------------------ fake cluster


@pytest.fixture(scope="module")
def fake_nodes(tmp_path_factory) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("fake-nodes")
    nodes = Nodes(workdir)
    slow = workdir / "slow-model"
    slow.mkdir()
    (slow / "fake_engine.json").write_text(
        json.dumps({"decode_step_s": 0.02, "prefill_s_per_token": 0.001}))
    fast = ["--engine", "fake", "--model", str(workdir)]
    faults = (f"[transfer]\nstrategy = \"streamed\"\ntransfer_timeout_s = {FAULT_TIMEOUT_S}\n"
              "[prefill_scheduler]\nmax_handoff_retries = 1\nretry_after_s = 0.2\n")
    binds = {name: f"{LOOPBACK}:{free_port()}" for name in ("decode", "tight", "victim")}
    allowlist = {"MLXCEL_DECODE_ALLOWLIST": ",".join(binds.values())}
    started = {
        "decode": nodes.start("decode", "decode-fake", ["--engine", "fake", "--model",
                                                         str(slow)], faults, bind=binds["decode"]),
        "tight": nodes.start("decode", "decode-tight", fast,
                             faults + "[decode_scheduler]\ningestion_queue_size = 1\n",
                             bind=binds["tight"]),
        "victim": nodes.start("decode", "decode-victim", fast, faults, bind=binds["victim"]),
        "prefill": nodes.start("prefill", "prefill-fake", ["--engine", "fake", "--model",
                                                           str(slow)], faults, env=allowlist),
    }
    try:
        nodes.wait_all(60)
        yield {"nodes": nodes, **started}
    finally:
        nodes.stop_all()


def fake_fingerprint(**changes) -> ModelFingerprint:
    fingerprint = ModelFingerprint.from_dict(FakeEngine(FakeEngineSettings()).info.fingerprint)
    return ModelFingerprint(**{**fingerprint.__dict__, **changes})


def handoff_header(request_id: str, prompt: list[int], fingerprint: ModelFingerprint,
                   max_tokens: int = 4) -> HandoffHeader:
    request = GenerationRequest(request_id, tuple(prompt), max_tokens, SamplingParams())
    return HandoffHeader(request_id, f"h-{request_id}", 1, fingerprint, len(prompt), 5,
                         sampling=SerializableSamplingState.from_request(request))


def handoff_frames(request_id: str, prompt: list[int], fingerprint: ModelFingerprint,
                   max_tokens: int = 4) -> list[Frame]:
    header = handoff_header(request_id, prompt, fingerprint, max_tokens)
    settings = FakeEngineSettings()
    layers = [make_layer(tuple(prompt), i, settings) for i in range(settings.num_layers)]
    messages = plan_transfer(FullTransfer(), header, CacheState(layers))
    return [message_to_frame(m, 5 if m.kind == "end" else None) for m in messages]


async def as_prefill(nodes: Nodes, decode: NodeProcess) -> Link:
    return await dial_link(decode.serving_bind, nodes.secret, "prefill", "test-prefill",
                           expect_roles={"decode"})


async def claimed_then_dialed(nodes: Nodes, decode: NodeProcess, request_id: str
                              ) -> tuple[Link, Link]:
    """A router link that claimed ``request_id`` on ``decode``, and a prefill link to it."""
    router_link = await dial_link(decode.serving_bind, nodes.secret, "router", "r",
                                  expect_roles={"decode"})
    await router_link.send(Request(request_id, [], max_tokens=4, claim=True).to_frame())
    return router_link, await as_prefill(nodes, decode)


async def final_result(link: Link, timeout_s: float) -> dict:
    """The header of the request's last RESULT (the one with a finish reason) on ``link``."""
    async with asyncio.timeout(timeout_s):
        while True:  # bounded by the timeout
            frame = await link.recv()
            if frame.type is FrameType.RESULT and frame.header.get("finish_reason"):
                return frame.header


async def next_ack(link: Link, timeout_s: float = 5.0) -> AckHeader:
    async with asyncio.timeout(timeout_s):
        while True:  # bounded by the timeout
            frame = await link.recv()
            if frame.type is FrameType.KV_ACK:
                return AckHeader.from_dict(frame.header)


def test_fake_cluster_completes_stops_and_reports_telemetry(fake_nodes):
    nodes, prefill, decode = fake_nodes["nodes"], fake_nodes["prefill"], fake_nodes["decode"]
    prompt = [5, 6, EOS_TRIGGER_TOKEN_ID]

    async def go():
        async with driver(nodes, prefill, decode) as link_driver:
            normal = await link_driver.generate("ok", [9] * 40, 5)
            eos_first = await link_driver.generate("eos", prompt, 5)
            one = await link_driver.generate("one", [9, 9], 1)
            await asyncio.sleep(0.6)
            return normal, eos_first, one, link_driver.telemetry

    normal, eos_first, one, telemetry = run(go())
    assert normal.tokens == expected_tokens(GenerationRequest("ok", (9,) * 40, 5))
    assert eos_first.tokens == [2] and eos_first.finish_reason == "stop"
    assert len(one.tokens) == 1 and one.finish_reason == "length"
    assert {"prefill", "decode"} <= set(telemetry)
    assert telemetry["decode"][-1].node_id == "decode-fake"
    wait_baseline(decode)
    wait_baseline(prefill)


def test_cancel_and_router_link_loss_free_everything(fake_nodes):
    nodes, prefill, decode = fake_nodes["nodes"], fake_nodes["prefill"], fake_nodes["decode"]

    async def go():
        async with driver(nodes, prefill, decode) as link_driver:
            collector = await link_driver.submit("long", [3] * 20, 500)
            while len(collector.outcome.tokens) < 3 and not collector.done.is_set():
                await asyncio.sleep(0.02)  # bounded: the stream runs at 50 tokens/s
            assert health(decode)["active"] == 1
            await link_driver.cancel("long")
            queued = await link_driver.submit("orphan", [4] * 30, 500)
            await asyncio.sleep(0.3)
            assert not queued.done.is_set()
        # The driver's links closed: the orphan's claim and sequence are dropped.

    run(go())
    wait_baseline(decode)
    wait_baseline(prefill)


def test_malformed_and_oversized_frames_fail_only_their_request(fake_nodes):
    nodes, prefill, decode = fake_nodes["nodes"], fake_nodes["prefill"], fake_nodes["decode"]

    async def go():
        async with driver(nodes, prefill, decode) as link_driver:
            bad = link_driver.expect("bad")
            await link_driver.prefill.send(
                Frame(FrameType.REQUEST, {"request_id": "bad", "max_tokens": "x"}))
            long = await link_driver.submit("long", [3] * 5000, 4)  # > fake context 4096
            forged = await link_driver.submit("forged", [3], 4, decode_target="10.9.9.9:1")
            outcomes = [await link_driver.wait(c, 10) for c in (bad, long, forged)]
            fine = await link_driver.generate("fine", [8] * 10, 3)
            return outcomes, fine

    (bad, long, forged), fine = run(go())
    assert bad.error_code == "frame_malformed"
    assert long.error_code == "context_length_exceeded"
    assert forged.error_code == "decode_target_refused"
    assert fine.ok
    wait_baseline(decode)


def test_kv_for_unknown_cancelled_and_mismatched_requests_is_refused(fake_nodes):
    nodes, decode = fake_nodes["nodes"], fake_nodes["victim"]

    async def go():
        link = await as_prefill(nodes, decode)
        other_model = handoff_header("mismatch", [4] * 8, fake_fingerprint(head_dim=16))
        await link.send(message_to_frame(other_model.to_message()))
        fingerprint_ack = await next_ack(link)
        # Claimed, then cancelled: its KV is refused at the begin.
        router_link = await dial_link(decode.serving_bind, nodes.secret, "router", "r",
                                      expect_roles={"decode"})
        await router_link.send(Request("gone", [], max_tokens=4, claim=True).to_frame())
        await router_link.send(Frame(FrameType.CANCEL, {"request_id": "gone"}))
        await asyncio.sleep(0.2)
        for frame in handoff_frames("gone", [4] * 8, fake_fingerprint()):
            await link.send(frame)
        cancelled_ack = await next_ack(link)
        for frame in handoff_frames("never-claimed", [4] * 8, fake_fingerprint()):
            await link.send(frame)
        # Complete, unacked, waiting for a claim (until FAULT_TIMEOUT_S drops it).
        held = await health_when(decode, lambda state: state["ready"] == 1)
        unknown_ack = await next_ack(link, FAULT_TIMEOUT_S + 3)
        await router_link.close()
        await link.close()
        return fingerprint_ack, cancelled_ack, held, unknown_ack

    fingerprint_ack, cancelled_ack, held, unknown_ack = run(go())
    assert (fingerprint_ack.ok, fingerprint_ack.error_code) == (False,
                                                                "handoff_fingerprint_mismatch")
    assert (cancelled_ack.ok, cancelled_ack.error_code) == (False, "unknown_request")
    assert held["ready"] == 1
    assert (unknown_ack.request_id, unknown_ack.error_code) == ("never-claimed",
                                                                "unknown_request")
    wait_baseline(decode, FAULT_TIMEOUT_S + 3)


def test_prefill_disappearing_mid_handoff_errors_the_claim(fake_nodes):
    nodes, decode = fake_nodes["nodes"], fake_nodes["victim"]

    async def go():
        router_link, link = await claimed_then_dialed(nodes, decode, "half")
        frames = handoff_frames("half", [4] * 8, fake_fingerprint())
        for frame in frames[:3]:  # begin and two chunks, then the prefill node is gone
            await link.send(frame)
        await link.drain()
        assert (await health_when(decode, lambda state: state["ingesting"] == 1))["ingesting"] == 1
        await link.close()
        header = await final_result(router_link, FAULT_TIMEOUT_S + 3)
        await router_link.close()
        return header

    result = run(go())
    assert result["request_id"] == "half" and result["finish_reason"] == "error"
    wait_baseline(decode)


def test_a_handoff_slower_than_the_timeout_lands_while_its_frames_keep_coming(fake_nodes):
    """transfer_timeout_s bounds a stall, not a handoff: frames 0.4 of the timeout apart,
    2.8 timeouts end to end, and the claim decodes (it timed out from its start before)."""
    nodes, decode = fake_nodes["nodes"], fake_nodes["victim"]

    async def go():
        router_link, link = await claimed_then_dialed(nodes, decode, "slow")
        started = time.monotonic()
        for frame in handoff_frames("slow", [4] * 8, fake_fingerprint()):
            await link.send(frame)
            await link.drain()
            await asyncio.sleep(0.4 * FAULT_TIMEOUT_S)  # a slow sender, pacing on purpose
        ack = await next_ack(link)
        took = time.monotonic() - started
        last = await final_result(router_link, FAULT_TIMEOUT_S + 3)
        await router_link.close()
        await link.close()
        return ack, took, last

    ack, took, last = run(go())
    assert took > 2 * FAULT_TIMEOUT_S
    assert ack.ok, ack.error
    assert last["request_id"] == "slow" and last["finish_reason"] != "error"
    wait_baseline(decode)


def test_decode_at_capacity_is_retried_then_reported(fake_nodes):
    nodes, prefill, tight = fake_nodes["nodes"], fake_nodes["prefill"], fake_nodes["tight"]

    async def go():
        link = await as_prefill(nodes, tight)
        for frame in handoff_frames("squatter", [4] * 8, fake_fingerprint()):
            await link.send(frame)
        # Unclaimed, it holds the only ingestion slot once it is in.
        await health_when(tight, lambda state: state["ready"] == 1)
        async with driver(nodes, prefill, tight) as link_driver:
            outcome = await link_driver.generate("refused", [6] * 8, 4, timeout_s=10)
        await link.close()
        return outcome

    outcome = run(go())
    assert outcome.finish_reason == "error" and "at_capacity" in (outcome.error or "")
    assert len(outcome.tokens) == 1  # the first token still came from prefill
    assert "mlxcel:handoff_retries_total 1.0" in metrics(prefill)
    wait_baseline(tight, FAULT_TIMEOUT_S + 3)
    wait_baseline(prefill)


def test_decode_disappearing_mid_handoff_fails_only_that_request(fake_nodes):
    nodes, prefill, victim = fake_nodes["nodes"], fake_nodes["prefill"], fake_nodes["victim"]
    decode = fake_nodes["decode"]

    async def go():
        async with driver(nodes, prefill, victim) as link_driver:
            # 2000 tokens at 1 ms/token: layers stream for ~2 s; the decode node dies meanwhile.
            collector = await link_driver.submit("doomed", [7] * 2000, 4)
            await asyncio.sleep(0.8)
            victim.process.kill()
            doomed = await link_driver.wait(collector, 15)
        async with driver(nodes, prefill, decode) as link_driver:
            fine = await link_driver.generate("after", [7] * 20, 4)
        return doomed, fine

    doomed, fine = run(go())
    assert doomed.finish_reason == "error"
    assert fine.ok
    wait_baseline(prefill)
