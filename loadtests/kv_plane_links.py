"""The links of ``bench_kv_plane.py`` and what is measured on each: loopback, veth, and
veth shaped with ``tc tbf`` (proved first with raw TCP); per link and size the raw TCP
and bare AES-GCM baselines, the product's handoffs, and the ITL phase.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import GIB, KVPlaneDefaults, Placement, proc_minor_faults
from kv_plane_nodes import (
    Handoff,
    NodeSet,
    handoffs,
    itl_phase,
    loopback_nodes,
    netns_nodes,
    warm_up,
)

from mlxcel_plugin.config import prefix_cache_config
from mlxcel_plugin.local_cluster import LOOPBACK, free_port
from mlxcel_plugin.testing.netns import DEVICE, LATENCY_MS, NetnsTopology, tbf_args

BASELINES = Path(__file__).resolve().parent / "tcp_baselines.py"
LINK_RATES: dict[str, float | None] = {"loopback": None, "veth": None, "tbf1": 1e9,
                                       "tbf10": 10e9, "tbf25": 25e9}
SHAPED_ENOUGH = 0.9  # raw TCP must reach this share of a shaped rate to prove the shaping
WIDE_BURST_S = 0.016  # the second try's tbf bucket, in seconds of the rate
BASELINE_TIMEOUT_S = 600
BASELINE_PATHS = (("raw TCP", False), ("bare AES-GCM", True))  # (path, with AES-GCM)
WARMUP_TOKENS = 256
# A node in service takes a handoff into the pages an earlier one of its size freed; after
# another size (8k after 2k) its receive pool (and prefix cache) take a few handoffs to turn
# over. Unmeasured handoffs per size until one lands warm: the decode node's minor faults under
# this many per GiB (of 262,144 4 KiB pages; warm handoffs took 0.3-3k here, fresh 30k+), at most:
WARM_FAULTS_PER_GIB, MAX_WARM_HANDOFFS = 8192, 8
# A decode node also keeps each handed-off prompt in its prefix cache (the received buffers
# themselves), so until that cache is full and evicts, every handoff lands in fresh pages:
# 512-token handoffs took 14k faults each with the default 1 GiB cache filling, 70 with it
# off. And after another size it turns over: once the last of that size was evicted, 2k
# handoffs after 8k ones landed warm, then one of the next ones cold again (0.59 against
# 0.23 s over the 10 Gbit/s link). So warming goes on until the cache has turned over, at
# most this many handoffs more.
MAX_PREFIX_FILL_HANDOFFS = 24


def prefix_held(kv_bytes: int, decode_sections: dict[str, dict[str, Any]] | None) -> int:
    """Handoffs of ``kv_bytes`` the decode node's prefix cache holds (at most
    ``MAX_PREFIX_FILL_HANDOFFS``): its budget resolved as the node resolves it (its
    ``[prefix_cache]`` table, ``MLXCEL_PREFIX_CACHE_BYTES``)."""
    section = (decode_sections or {}).get("prefix_cache", {})
    held = prefix_cache_config(os.environ, section, None).max_bytes // max(kv_bytes, 1)
    return min(MAX_PREFIX_FILL_HANDOFFS, held)


@dataclass
class LinkRun:
    """What every link measures, and with what."""

    model: str
    workdir: Path
    sizes: list[int]
    bytes_per_token: int
    configs: list[str]
    repeats: int
    placement: Placement
    plane: KVPlaneDefaults
    itl: dict[str, Any] | None
    rng: Any
    decode_sections: dict[str, dict[str, Any]] | None = None  # the decode node's TOML tables


@dataclass
class Endpoints:
    """Where baselines run: argv prefixes per side and the sink's address."""

    send_prefix: list[str]
    sink_prefix: list[str]
    host: str
    port: int


# ---------------------------------------------------------------- baselines


def baseline(ends: Endpoints, size: int, plane: KVPlaneDefaults, aes: bool) -> dict[str, float]:
    """One transfer of ``size`` bytes through ``tcp_baselines.py``: seconds, CPU per side."""
    common = [str(size), "--lanes", str(plane.lanes), "--record", str(plane.record_bytes)]
    common += ["--aes"] if aes else []
    me = [sys.executable, str(BASELINES)]
    sink = subprocess.Popen([*ends.sink_prefix, *me, "sink", ends.host, str(ends.port), *common],
                            stdout=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError("baseline sink did not start")
        sent = subprocess.run([*ends.send_prefix, *me, "send", ends.host, str(ends.port),
                               *common], capture_output=True, text=True, check=True,
                              timeout=BASELINE_TIMEOUT_S)
        received = json.loads(sink.stdout.readline())
    except BaseException:  # Ctrl-C or a failed sender: the sink would wait on for it
        sink.kill()
        raise
    finally:
        try:
            sink.wait(timeout=BASELINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            sink.kill()
            sink.wait()
    send = json.loads(sent.stdout.strip().splitlines()[-1])
    return {"seconds": send["seconds"], "cpu_send": send["cpu_s"], "cpu_recv": received["cpu_s"]}


def measure_row(link: str, tokens: int, path: str, size: int, wire: float,
                runs: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over repeats; CPU per GiB from sums (the repeats' total over their bytes)."""
    gib = size * len(runs) / GIB
    return {"link": link, "tokens": tokens, "path": path, "bytes": size, "wire_bytes": wire,
            "seconds": statistics.median(r["seconds"] for r in runs),
            "cpu_send_per_gib": sum(r["cpu_send"] for r in runs) / gib,
            "cpu_recv_per_gib": sum(r["cpu_recv"] for r in runs) / gib}


# ---------------------------------------------------------------- the product


async def warm_handoffs(nodes: NodeSet, config: str, tokens: int, run: LinkRun) -> list:
    """Unmeasured handoffs of this size: the first lands in fresh pages (its receiver CPU is
    reported as cold), then more until the prefix cache has turned over (more handoffs than
    it holds: ``prefix_held``) and one lands warm (``WARM_FAULTS_PER_GIB``): the receive
    pool turned over to this size (docs/bulk-lanes.md#receive-pool). All of them, in order."""
    pid, done = nodes.decode.process.pid, []
    held = prefix_held(tokens * run.bytes_per_token, run.decode_sections)
    while len(done) < MAX_WARM_HANDOFFS + held:  # bounded
        before = proc_minor_faults(pid)
        done += await handoffs(nodes, config, tokens, 1, run.rng)
        faults = (proc_minor_faults(pid) - before) / (done[-1].kv_bytes / GIB)
        if len(done) > max(1, held) and faults < WARM_FAULTS_PER_GIB:
            break
    return done


async def size_rows(link: str, nodes: NodeSet, ends: Endpoints, tokens: int,
                    run: LinkRun) -> list[dict]:
    """Every path at one size: each config's unmeasured handoffs first (``warm_handoffs``; the
    first one's receiver CPU is reported as ``cold``), then ``repeats`` rounds of one run of
    each path (raw TCP, bare AES-GCM, each config). Why rounds: this machine's slow spells
    (whole handoffs at half speed on both nodes, no page faults, tens of seconds) then fall
    on every path alike, where one path's runs back to back could all land in one."""
    size = tokens * run.bytes_per_token
    warm = {}
    for config in run.configs:
        try:
            warm[config] = await warm_handoffs(nodes, config, tokens, run)
        except (RuntimeError, TimeoutError) as exc:  # one failed case does not end the run
            print(f"{link} {tokens} {config} failed: {exc}", flush=True)
    baselines: dict[str, list[dict[str, float]]] = {path: [] for path, _ in BASELINE_PATHS}
    done: dict[str, list[Handoff]] = {config: [] for config in warm}
    for _ in range(max(1, run.repeats)):
        for path, aes in BASELINE_PATHS:
            baselines[path].append(baseline(ends, size, run.plane, aes))
        for config in list(done):
            try:
                done[config] += await handoffs(nodes, config, tokens, 1, run.rng)
            except (RuntimeError, TimeoutError) as exc:
                print(f"{link} {tokens} {config} failed: {exc}", flush=True)
                del done[config]
    rows = [measure_row(link, tokens, path, size, size, runs) for path, runs in baselines.items()]
    rows += [product_row(link, tokens, config, warm[config], handoffs_done)
             for config, handoffs_done in done.items()]
    for row in rows:
        print(row, flush=True)
    return rows


def product_row(link: str, tokens: int, config: str, warm: list[Handoff],
                done: list[Handoff]) -> dict[str, Any]:
    """A config's measured handoffs as one row, beside its first warm-up's cold figure."""
    runs = [{"seconds": h.transfer_s, "cpu_send": h.cpu_s[0], "cpu_recv": h.cpu_s[1]}
            for h in done]
    row = measure_row(link, tokens, config, done[0].kv_bytes,
                      statistics.median(h.wire_bytes for h in done), runs)
    row["chosen"] = f"{done[-1].choice['strategy']}/{done[-1].choice['codec']}"
    row["tt2t_s"] = statistics.median(h.tt2t_s for h in done)
    row["prefill_s"] = statistics.median(h.prefill_s for h in done)
    row["after_ack_s"] = statistics.median(h.after_ack_s for h in done)
    row["step_cpu_s"] = statistics.median(h.step_cpu_s for h in done)
    row["cold_cpu_recv_per_gib"] = warm[0].cpu_s[1] / (warm[0].kv_bytes / GIB)
    row["warm_handoffs"] = len(warm)
    shares = [h.reader_busy_share for h in done if h.reader_busy_share is not None]
    row["reader_busy"] = statistics.median(shares) if shares else None
    roles = sorted({role for h in done for role in h.recv_threads_s})
    row["recv_threads_ms"] = {role: 1000 * statistics.median(
        h.recv_threads_s.get(role, 0.0) for h in done) for role in roles}
    row["from"] = "end of prefill" if all(h.whole for h in done) else "submit"
    return row


async def measure_link(link: str, rate: float | None, nodes: NodeSet, ends: Endpoints,
                       run: LinkRun, proof: dict[str, Any] | None) -> dict[str, Any]:
    await warm_up(nodes, WARMUP_TOKENS, run.rng)
    rows: list[dict[str, Any]] = []
    for tokens in run.sizes:
        rows += await size_rows(link, nodes, ends, tokens, run)
    itl = None
    if run.itl is not None and "full-none" in nodes.prefills:
        itl = await itl_phase(nodes, "full-none", run.itl["tokens"], run.itl["streams"],
                              run.itl["handoffs"], run.itl["quiet_s"], run.rng)
        print({"link": link, "itl_gaps": {k: len(v) if isinstance(v, list) else v
                                           for k, v in itl.items()}}, flush=True)
    return {"link": link, "rate_bits": rate, "proof": proof, "rows": rows, "itl": itl,
            "decode_idle_ms_per_s": round(1000 * nodes.idle_cpu.get("all", 0.0), 2)}


async def run_loopback(run: LinkRun) -> dict[str, Any]:
    nodes = loopback_nodes(run.model, run.workdir / "loopback", run.configs, run.placement,
                           run.decode_sections)
    try:
        ends = Endpoints(run.placement.taskset("sender"), run.placement.taskset("receiver"),
                         LOOPBACK, free_port())
        return await measure_link("loopback", None, nodes, ends, run, None)
    finally:
        nodes.stop()


# ---------------------------------------------------------------- namespaces


def shape(net: NetnsTopology, rate: float | None, burst_s: float | None = None) -> None:
    """Both hosts' links at ``rate`` (None: unshaped); ``burst_s`` widens the tbf bucket."""
    for name in net.names:
        if rate is None or burst_s is None:
            net.set_rate(name, rate)
            continue
        host = net.hosts[name]
        args = tbf_args(rate)
        args[args.index("burst") + 1] = str(int(rate / 8 * burst_s))
        args[args.index("latency") + 1] = f"{2 * LATENCY_MS}ms"
        for namespace, device in ((host.namespace, DEVICE), (net.hub, host.hub_device)):
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev",
                            device, "root", *args], check=True, capture_output=True, timeout=20)


def prove_shaping(net: NetnsTopology, ends: Endpoints, rate: float, run: LinkRun) -> dict:
    """Raw TCP over the shaped link must reach >= 0.9x the rate; widen the burst once if not."""
    size = max(run.sizes) * run.bytes_per_token
    tries = []
    for burst_s in (None, WIDE_BURST_S):
        shape(net, rate, burst_s)
        reached = size / baseline(ends, size, run.plane, aes=False)["seconds"] * 8
        tries.append({"burst_s": burst_s, "raw_bits_per_s": reached})
        if reached >= SHAPED_ENOUGH * rate:
            break
    best = max(tries, key=lambda t: t["raw_bits_per_s"])
    shape(net, rate, best["burst_s"])
    proven = best["raw_bits_per_s"] >= SHAPED_ENOUGH * rate
    proof = {"rate_bits": rate, "proven": proven, "tries": tries,
             "reference_bits": rate if proven else best["raw_bits_per_s"]}
    print({"shaping": proof}, flush=True)
    return proof


def netns_links(run: LinkRun, links: list[str]) -> list[dict[str, Any]]:
    """Every namespace link in one topology: nodes started once, the rate changed per link."""
    if not links:
        return []
    from mlxcel_plugin.testing.netns import unavailable_reason
    from mlxcel_plugin.testing.netns_nodes import NetnsNodes

    reason = unavailable_reason()
    if reason:
        print(f"namespace links {links} skipped: {reason}", flush=True)
        return []
    results = []
    with NetnsTopology(("prefill", "decode")) as net:
        nodes = netns_nodes(run.model, NetnsNodes(net, run.workdir / "netns"), run.configs,
                            run.placement, run.decode_sections)
        try:
            ends = Endpoints(run.placement.taskset("sender") + net.exec_argv("prefill", []),
                             run.placement.taskset("receiver") + net.exec_argv("decode", []),
                             net.address("decode"), 7000)
            for link in links:
                rate = LINK_RATES[link]
                shape(net, rate)
                proof = prove_shaping(net, ends, rate, run) if rate else None
                results.append(asyncio.run(measure_link(link, rate, nodes, ends, run, proof)))
        finally:
            nodes.stop()
    return results
