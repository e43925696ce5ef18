"""Real node processes for ``bench_kv_plane.py``: one decode node and one prefill node per
transfer configuration, all on the zero-compute KV source (``--engine synthetic-kv``),
on loopback or on two hosts of a ``NetnsTopology``; and the two measurements made
through them over the product's link: one handoff (time, bytes, CPU of each side),
and the ITL of running streams on the decode node with and without a handoff arriving.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from statistics import median
from typing import Any

from bench_common import prometheus_value
from harness import CpuSampler, Placement, pin_all

from mlxcel_plugin.link import ClusterSecret, generate_secret_file, load_cluster_secret
from mlxcel_plugin.link.protocol.frames import Cancel, Request
from mlxcel_plugin.local_cluster import LOOPBACK, NodeProcess, free_port, start_node
from mlxcel_plugin.testing.link_driver import LinkDriver

TIMEOUT_S = 600.0
TRANSFER_TIMEOUT_S = 300  # a claim waits this long for its KV on a loaded machine
VOCAB = 1000  # prompts draw ids below the synthetic model's vocabulary (1024)
# A handoff's tokens: the prefill node's, the decode node's first over the adopted cache,
# then three plain steps, whose median CPU is what the first is charged for its model.
TOKENS = 5
STREAM_TOKENS = 4096  # an ITL stream's max_tokens: more than a window's steps
IDLE_S = 2.0  # how long the decode node's idle background is measured (measure_idle)
SETTLE_S = 1.0  # after an ITL window's streams all joined: the join's step is behind them
QUIET_LEAD_S = 1.5  # a quiet window's start after SETTLE_S, until a handoff's prefill is timed
CONFIGS: dict[str, dict[str, Any]] = {  # name -> [transfer] table
    "full-none": {"strategy": "full", "codec": "none"},
    "streamed-none": {"strategy": "streamed", "codec": "none"},
    "layer-parallel-none": {"strategy": "layer-parallel", "codec": "none", "parallelism": 2},
    "full-int8": {"strategy": "full", "codec": "int8", "allow_lossy": True},
    "streamed-int8": {"strategy": "streamed", "codec": "int8", "allow_lossy": True},
}


def node_toml(transfer: dict[str, Any], sections: dict[str, dict[str, Any]] | None = None) -> str:
    """A node's TOML: ``[transfer]``, and ``sections`` (name -> keys) as given."""
    tables = {"transfer": {**transfer, "transfer_timeout_s": TRANSFER_TIMEOUT_S},
              **(sections or {})}
    return "".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
                   for name, keys in tables.items())


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


@dataclass
class NodeSet:
    """A decode node and prefill nodes by config name, sharing one cluster secret."""

    secret: ClusterSecret
    decode: NodeProcess
    prefills: dict[str, NodeProcess]
    urls: dict[str, str]  # node name -> ops URL ("decode", config names)
    # The decode node's CPU seconds per second with nothing to do (its timers), by thread
    # role and "all": ``measure_idle``.
    idle_cpu: dict[str, float] = field(default_factory=dict)

    def pids(self, config: str) -> list[int]:
        return [self.prefills[config].process.pid, self.decode.process.pid]

    def driver(self, config: str) -> LinkDriver:
        return LinkDriver(self.secret, self.prefills[config].serving_bind,
                          self.decode.serving_bind)

    def stop(self) -> None:
        for node in [*self.prefills.values(), self.decode]:
            node.stop()


def node_args(model: str, secret_path: Path) -> list[str]:
    return ["--engine", "synthetic-kv", "--model", model, "--cluster-secret-file",
            str(secret_path)]


def loopback_nodes(model: str, workdir: Path, configs: list[str], placement: Placement,
                   decode_sections: dict[str, dict[str, Any]] | None = None) -> NodeSet:
    """Every node on 127.0.0.1 in this namespace (the loopback link)."""
    workdir.mkdir(parents=True, exist_ok=True)
    secret_path = workdir / "cluster.secret"
    generate_secret_file(secret_path)
    started: dict[str, NodeProcess] = {}
    try:
        for name in ["decode", *configs]:
            role = "decode" if name == "decode" else "prefill"
            toml = workdir / f"{name}.toml"
            toml.write_text(node_toml(CONFIGS.get(name, {}),
                                      decode_sections if role == "decode" else None))
            args = [*node_args(model, secret_path), "--distributed-config", str(toml)]
            cores = placement.receiver if role == "decode" else placement.sender
            started[name] = start_node(role, workdir, args, name=name, cpu_affinity=cores,
                                       serving_bind=f"{LOOPBACK}:{free_port()}")
        for node in started.values():
            node.wait_healthy(TIMEOUT_S)
    except BaseException:
        for node in started.values():
            node.stop()
        raise
    decode = started.pop("decode")
    urls = {"decode": decode.url, **{n: node.url for n, node in started.items()}}
    return NodeSet(load_cluster_secret(str(secret_path), {}), decode, started, urls)


def netns_nodes(model: str, nodes: Any, configs: list[str], placement: Placement,
                decode_sections: dict[str, dict[str, Any]] | None = None) -> NodeSet:
    """The decode node on host "decode", prefill nodes on host "prefill" (``NetnsNodes``)."""
    engine_args = ["--engine", "synthetic-kv", "--model", model]  # NetnsNodes adds the secret
    decode = nodes.start("decode", "decode", "decode", engine_args,
                         node_toml({}, decode_sections))
    pin_all(decode.process.pid, placement.receiver)
    prefills = {}
    for name in configs:
        prefills[name] = nodes.start("prefill", "prefill", f"prefill-{name}", engine_args,
                                     node_toml(CONFIGS[name]))
        pin_all(prefills[name].process.pid, placement.sender)
    nodes.wait_all(TIMEOUT_S)
    urls = {"decode": decode.url, **{n: node.url for n, node in prefills.items()}}
    return NodeSet(nodes.secret, decode, prefills, urls)


# ---------------------------------------------------------------- one handoff


@dataclass
class Handoff:
    """One request through prefill -> handoff -> decode's first token.

    ``transfer_s`` and the prefill node's ``cpu_s`` cover the transfer: for Full, from the
    end of prefill to the decode node's ack (the prefill node's
    ``mlxcel:handoff_time_seconds``); a streaming strategy sends rows while prefill still
    fills, so for it they run from the submit (the zero-compute prefill's fill included).
    The decode node's CPU runs from the submit for every strategy (every begin comes then,
    and the receive buffers of the layers it implies are allocated then:
    kv_serde/expected_layers.py) on to its first token (receiving, adopting into MLX, and
    that token's decode step), less its idle background over the prefill
    (``NodeSet.idle_cpu``: its timers, not the handoff's) and less ``step_cpu_s``: the median
    CPU of its next decode steps over the same cache (the model's attention over the KV,
    which any node pays per token: not the handoff's work; the first step's extra work, such
    as copying what it adopted, stays counted).
    """

    kv_bytes: int  # raw KV handed over (what the decode node gets)
    wire_bytes: float  # encoded bytes (the prefill node's mlxcel:handoff_bytes)
    prefill_s: float  # submit to the prefill node's token
    transfer_s: float
    tt2t_s: float  # submit to the decode node's first token
    after_ack_s: float  # the decode node's ack to its first token (adoption, first step)
    cpu_s: list[float]  # prefill node, decode node (its next steps' median CPU taken off)
    step_cpu_s: float = 0.0  # the median of the decode node's next steps over the same cache
    choice: dict[str, Any] = field(default_factory=dict)
    # How busy the decode node's readers were (its ack): >= 0.8, the receiver set the pace.
    reader_busy_share: float | None = None
    # The decode node's cpu_s[1] by thread role (harness.ThreadCpu), the steps' median taken off.
    recv_threads_s: dict[str, float] = field(default_factory=dict)

    @property
    def whole(self) -> bool:
        """Sent after prefill (Full): the transfer window holds nothing else."""
        return self.choice.get("strategy") == "full"


def handoff_totals(url: str) -> tuple[float, float]:
    text = get(f"{url}/metrics")
    return (prometheus_value(text, "mlxcel:handoff_time_seconds_sum") or 0.0,
            prometheus_value(text, "mlxcel:handoff_bytes_sum") or 0.0)


def prompt(tokens: int, rng: random.Random) -> list[int]:
    """Fresh random ids: no prefix of it is cached anywhere."""
    return [rng.randrange(3, VOCAB) for _ in range(tokens)]


async def one_handoff(driver: LinkDriver, url: str, sampler: CpuSampler, request_id: str,
                      tokens: int, rng: random.Random, idle: dict[str, float]) -> Handoff:
    before = handoff_totals(url)
    start = time.perf_counter()
    outcome = await driver.generate(request_id, prompt(tokens, rng), TOKENS,
                                    timeout_s=TIMEOUT_S)
    if not outcome.ok or len(outcome.token_times_s) < TOKENS:
        raise RuntimeError(f"{request_id}: {outcome.finish_reason} {outcome.error}")
    after = handoff_totals(url)
    # The prefill node's token, the decode node's first, then plain steps.
    prefilled, decoded = outcome.token_times_s[:2]
    steps = list(pairwise(outcome.token_times_s[1:TOKENS]))
    acked = prefilled + after[0] - before[0]
    transfer = json.loads(get(f"{url}/health"))["transfer"]
    choice = transfer["last_choice"]
    begin = prefilled if choice.get("strategy") == "full" else start
    step_cpu = median(sampler.between(a, b)[1] for a, b in steps)
    waited = prefilled - start  # the decode node's wait for the end of prefill
    cpu = [sampler.between(begin, acked)[0], sampler.between(start, max(decoded, acked))[1]
           - step_cpu - idle.get("all", 0.0) * waited]
    window = sampler.threads_between(start, max(decoded, acked))
    step_threads = [sampler.threads_between(a, b) for a, b in steps]
    threads = {role: seconds - median(s.get(role, 0.0) for s in step_threads)
               - idle.get(role, 0.0) * waited for role, seconds in window.items()}
    return Handoff(int(choice["payload_bytes"]), after[1] - before[1], prefilled - start,
                   acked - begin, decoded - start, decoded - acked, cpu, step_cpu, choice,
                   transfer.get("last_reader_busy_share"), threads)


async def handoffs(nodes: NodeSet, config: str, tokens: int, repeats: int,
                   rng: random.Random) -> list[Handoff]:
    with CpuSampler(nodes.pids(config), threads_of=nodes.decode.process.pid) as sampler:
        async with nodes.driver(config) as driver:
            return [await one_handoff(driver, nodes.urls[config], sampler,
                                      f"{config}-{tokens}-{i}-{rng.random():.6f}", tokens, rng,
                                      nodes.idle_cpu)
                    for i in range(repeats)]


async def warm_up(nodes: NodeSet, tokens: int, rng: random.Random) -> None:
    """One small handoff per prefill node: links dialled, compile caches warm; then the
    decode node's idle background (``measure_idle``)."""
    for config in nodes.prefills:
        await handoffs(nodes, config, tokens, 1, rng)
    nodes.idle_cpu = await measure_idle(nodes.decode.process.pid)


async def measure_idle(pid: int, seconds: float = IDLE_S) -> dict[str, float]:
    """A node's CPU seconds per second with no request (uvicorn's ticks, telemetry, the loop
    watchdog: 3.5-4 ms a second here), in all and by thread role."""
    await asyncio.sleep(SETTLE_S)  # the warm-up's stragglers: its link closing, its frees
    with CpuSampler([pid], threads_of=pid) as sampler:
        start = time.perf_counter()
        await asyncio.sleep(seconds)
        end = time.perf_counter()
    rates = {role: s / seconds for role, s in sampler.threads_between(start, end).items()}
    return {**rates, "all": sampler.between(start, end)[0] / seconds}


# ---------------------------------------------------------------- ITL while ingesting


@dataclass
class StreamPool:
    """``count`` streams decoding on the decode node (prefilled there) for one measured
    window; token arrival times per stream.

    The streams start together and run until ``stop()`` cancels them (``max_tokens``
    outlasts the window), so the batch holds the same ``count`` sequences throughout the
    window: a stream that ended and restarted inside it would leave and join the batch's
    group, and each such step copies the group's caches (mlx-lm's ``filter`` and ``extend``:
    2-3x a plain step), which set p99 apart from any handoff.
    """

    driver: LinkDriver
    count: int
    max_tokens: int = STREAM_TOKENS
    collectors: list[Any] = field(default_factory=list)

    async def start(self, tag: str) -> None:
        """Send every stream; return once each has two tokens (all in the batch)."""
        for slot in range(self.count):
            request_id = f"stream-{tag}-{slot}-{time.monotonic_ns()}"
            self.collectors.append(self.driver.expect(request_id))
            ids = [(7 * j + slot) % VOCAB + 3 for j in range(8)]
            await self.driver.decode.send(Request(request_id, ids, {}, self.max_tokens)
                                          .to_frame())
        deadline = time.perf_counter() + TIMEOUT_S
        while any(len(c.outcome.token_times_s) < 2 for c in self.collectors):
            if time.perf_counter() > deadline or any(c.done.is_set() for c in self.collectors):
                raise RuntimeError(f"ITL streams did not start: {self.collectors[0].outcome}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Cancel every stream on the decode node."""
        for collector in self.collectors:
            await self.driver.decode.send(Cancel(collector.outcome.request_id, "window over")
                                          .to_frame())

    def gaps_in(self, window: tuple[float, float]) -> list[float]:
        """Gaps between one stream's tokens (its first excluded) ending inside ``window``."""
        a, b = window
        found = []
        for collector in self.collectors:
            times = collector.outcome.token_times_s
            for earlier, later in zip(times[1:], times[2:], strict=False):
                if a <= later < b:
                    found.append(later - earlier)
        return found


async def ingest_window(driver: LinkDriver, url: str, tokens: int, tag: str,
                        rng: random.Random) -> tuple[float, float, float]:
    """One handoff of ``tokens`` to the decode node: (submit, end of prefill, ack)."""
    before = handoff_totals(url)
    submitted = time.perf_counter()
    outcome = await driver.generate(f"ingest-{tag}-{rng.random():.6f}", prompt(tokens, rng), 2,
                                    timeout_s=TIMEOUT_S)
    if not outcome.ok or len(outcome.token_times_s) < 2:
        raise RuntimeError(f"ingest {tag}: {outcome.finish_reason} {outcome.error}")
    # From the end of prefill to the decode node's ack: the bytes arriving and landing. Not
    # the step that takes the sequence in after it (its attention over the whole prompt,
    # which a stream pays beside any long prompt, handed over or not; adoption into MLX is
    # in it too: see "ack to 1st token s" less "step CPU s"). ``generate`` returns after
    # that step, and the window's streams are cancelled then: no measured gap holds it.
    prefilled = outcome.token_times_s[0]
    return submitted, prefilled, prefilled + handoff_totals(url)[0] - before[0]


async def itl_phase(nodes: NodeSet, config: str, tokens: int, streams: int, handoffs_n: int,
                    quiet_s: float, rng: random.Random) -> dict[str, Any]:
    """Streams' gaps in ``handoffs_n`` windows while a handoff of ``tokens`` lands, and in
    as many quiet windows, paired so both kinds see streams of the same age.

    Each window gets its own ``streams`` streams, started together and cancelled after it,
    so every window measures streams ``SETTLE_S`` + the handoff's prefill time into their
    life (a stream's step grows with its context: a quiet window later in one set of streams'
    life than the ingest windows would read slower for that alone). Quiet windows come first
    in each pair and last as long as the last ingest window (``quiet_s`` before the first).
    """
    url = nodes.urls[config]
    quiet_gaps: list[float] = []
    ingest_gaps: list[float] = []
    lead_s, length_s, ingest_s = QUIET_LEAD_S, quiet_s, 0.0
    async with nodes.driver(config) as driver:
        for k in range(2 * handoffs_n):
            pool = StreamPool(driver, streams)
            await pool.start(str(k))
            await asyncio.sleep(SETTLE_S)
            if k % 2 == 0:
                await asyncio.sleep(lead_s)
                begin = time.perf_counter()
                await asyncio.sleep(length_s)
                quiet_gaps += pool.gaps_in((begin, time.perf_counter()))
            else:
                submitted, prefilled, acked = await ingest_window(driver, url, tokens, str(k), rng)
                ingest_gaps += pool.gaps_in((prefilled, acked))
                lead_s, length_s = prefilled - submitted, acked - prefilled
                ingest_s += length_s
            await pool.stop()
    return {"quiet": quiet_gaps, "ingest": ingest_gaps, "ingest_s": ingest_s}
