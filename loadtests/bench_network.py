"""KV handoff over shaped links: prefill and decode nodes on separate hosts (network namespaces).

Real SmolLM2-135M nodes (fp32, OpenBLAS) on two hosts of a ``NetnsTopology``
(``mlxcel_plugin/testing/netns.py``), each host's link shaped with ``tc tbf``
to 1 and 10 Gbit/s; this process plays the router from the root namespace
(``LinkDriver``). One prefill node per configuration (strategy x codec, and
``auto`` with and without ``allow_lossy``), all handing off to one decode node.
Every request has a fresh random prompt (no prefix reuse).

Per rate, prompt length and configuration (medians over the repeats):

* TTFT: submit to the first token (prefill's, streamed at once by a router);
  TT2T: submit to the second token (decode's, after the handoff).
* handoff_s: the prefill node's ``mlxcel:handoff_time_seconds`` for that
  request, from the end of prefill to the decode node's ack.
* eff_x: raw KV bytes / handoff_s / the link's byte rate; for codecs it counts
  the KV the decode node gets, not the wire bytes. Streamed starts sending
  during prefill, so its handoff_s is only the part prefill did not hide;
  hidden_pct = 1 - handoff_s(streamed) / handoff_s(full), both codec none.
* CPU s/GiB per side (full only: the other strategies overlap prefill's CPU):
  each process's CPU time (its CPU clock, ``harness.proc_cpu_s``, sampled every 5 ms) over the
  handoff window, per GiB of raw KV; against a raw TCP transfer of the same
  bytes between the same namespaces (``sendall`` / ``recv_into``).
* chosen: what the prefill node's selector picked (``/health`` last_choice), and who
  set the pace it planned with (``paced_by``: only ``link`` is a measurement).

``--quick`` checks the mechanics in under a minute: the tiny checkpoint,
1 Gbit/s, 1024-token prompts, four configurations, one repeat. The README's
figures come from SmolLM2 runs (``--lengths 2048 --repeats 1``: minutes, as
SmolLM2 prefill on 2 shared cores takes ~10 s per 1k tokens). Needs root and
iproute2; elsewhere it prints why and exits 0.

Usage: python loadtests/bench_network.py [--quick] [--json PATH] [--rates 1,10]
       [--lengths 2048,8000] [--repeats 2] [--configs full-none,auto-lossy,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import (
    add_common_args,
    bench_result,
    format_table,
    prometheus_value,
    table,
    write_json,
)
from harness import GIB, CpuSampler, process_cpu_s

from mlxcel_plugin.testing.link_driver import LinkDriver
from mlxcel_plugin.testing.netns import NetnsTopology, unavailable_reason
from mlxcel_plugin.testing.netns_nodes import NetnsNode, NetnsNodes

RAW_PORT = 7000
WARMUP_TOKENS = 512  # measures the link for the selector and warms the engines
TIMEOUT_S = 600.0
# name -> [transfer] table
CONFIGS = {
    "full-none": {"strategy": "full", "codec": "none"},
    "streamed-none": {"strategy": "streamed", "codec": "none"},
    "layer-parallel-none": {"strategy": "layer-parallel", "codec": "none", "parallelism": 2},
    "full-lz4": {"strategy": "full", "codec": "lz4"},
    "full-int8": {"strategy": "full", "codec": "int8", "allow_lossy": True},
    "streamed-int8": {"strategy": "streamed", "codec": "int8", "allow_lossy": True},
    "full-auto-lossy": {"strategy": "full", "codec": "auto", "allow_lossy": True},
    "auto": {"strategy": "auto", "codec": "auto"},
    "auto-lossy": {"strategy": "auto", "codec": "auto", "allow_lossy": True},
}
QUICK_CONFIGS = ("full-none", "streamed-none", "full-auto-lossy", "auto-lossy")
COLUMNS = ["Gbit/s", "prompt", "config", "chosen", "seen MB/s", "KV MiB", "wire MiB", "TTFT s",
           "TT2T s", "handoff s", "eff x link", "prefill CPU s/GiB", "decode CPU s/GiB"]


# ---------------------------------------------------------------- raw TCP, bare link


def raw_sink(host: str, port: int, size: int) -> None:
    """Receive ``size`` bytes into a reused buffer, answer one byte, print CPU seconds."""
    with socket.create_server((host, port)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            start, got = process_cpu_s(), 0
            view = memoryview(bytearray(4 << 20))
            while got < size:  # bounded: each pass reads >= 1 byte or ends
                n = conn.recv_into(view)
                if n == 0:
                    break
                got += n
            conn.sendall(b"k")
            print(json.dumps({"bytes": got, "cpu_s": process_cpu_s() - start}), flush=True)


def raw_send(host: str, port: int, size: int) -> None:
    block = bytes(4 << 20)
    with socket.create_connection((host, port)) as conn:
        start, cpu = time.perf_counter(), process_cpu_s()
        for offset in range(0, size, len(block)):
            conn.sendall(memoryview(block)[: min(len(block), size - offset)])
        conn.recv(1)
        print(json.dumps({"seconds": time.perf_counter() - start,
                          "cpu_s": process_cpu_s() - cpu}), flush=True)


def raw_transfer(net: NetnsTopology, size: int) -> dict[str, float]:
    """Raw TCP of ``size`` bytes from the prefill host to the decode host."""
    me = [sys.executable, str(Path(__file__).resolve())]
    sink = subprocess.Popen(net.exec_argv("decode", [*me, "--raw-sink", net.address("decode"),
                                                     str(RAW_PORT), str(size)]),
                            stdout=subprocess.PIPE, text=True)
    try:
        sink.stdout.readline()  # "ready"
        sent = subprocess.run(net.exec_argv("prefill", [*me, "--raw-send", net.address("decode"),
                                                        str(RAW_PORT), str(size)]),
                              capture_output=True, text=True, check=True, timeout=TIMEOUT_S)
        received = json.loads(sink.stdout.readline())
    finally:
        sink.wait(timeout=TIMEOUT_S)
    send = json.loads(sent.stdout)
    return {"seconds": send["seconds"], "send_cpu_s": send["cpu_s"],
            "recv_cpu_s": received["cpu_s"]}


# ---------------------------------------------------------------- requests


@dataclass
class Sample:
    ttft_s: float
    tt2t_s: float
    handoff_s: float
    kv_bytes: int
    wire_bytes: float
    choice: dict[str, Any]
    cpu_s: list[float]  # prefill, decode over the handoff window


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def handoff_totals(prefill: NetnsNode) -> tuple[float, float]:
    text = get(f"{prefill.url}/metrics")
    return (prometheus_value(text, "mlxcel:handoff_time_seconds_sum") or 0.0,
            prometheus_value(text, "mlxcel:handoff_bytes_sum") or 0.0)


async def one_request(driver: LinkDriver, prefill: NetnsNode, sampler: CpuSampler,
                      request_id: str, tokens: int, rng: random.Random) -> Sample:
    prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
    before = handoff_totals(prefill)
    start = time.perf_counter()
    outcome = await driver.generate(request_id, prompt, 2, timeout_s=TIMEOUT_S)
    if not outcome.ok or len(outcome.token_times_s) < 2:
        raise RuntimeError(f"{request_id}: {outcome}")
    after = handoff_totals(prefill)
    handoff_s = after[0] - before[0]
    first_s = outcome.token_times_s[0]
    choice = json.loads(get(f"{prefill.url}/health"))["transfer"]["last_choice"]
    return Sample(first_s - start, outcome.token_times_s[1] - start, handoff_s,
                  choice["payload_bytes"], after[1] - before[1], choice,
                  sampler.between(first_s, first_s + handoff_s))


@dataclass
class Case:
    rate_gbit: float
    tokens: int
    config: str
    samples: list[Sample]

    def median(self, name: str) -> float:
        return statistics.median(getattr(s, name) for s in self.samples)

    @property
    def whole(self) -> bool:
        """Sent after prefill (full): handoff_s is the whole transfer, not a tail."""
        return all(s.choice["strategy"] == "full" for s in self.samples)

    def cpu_per_gib(self, side: int) -> float | None:
        if not self.whole:
            return None
        kv = sum(s.kv_bytes for s in self.samples) / GIB
        return sum(s.cpu_s[side] for s in self.samples) / kv

    def chosen(self) -> str:
        """The last choice, and who set the pace of the handoff before it (its bandwidth's)."""
        last = self.samples[-1].choice
        return f"{last['strategy']}/{last['codec']} ({last.get('paced_by', 'link')})"

    def seen_mb_s(self) -> float | None:
        """The bandwidth the selector planned the last handoff with (measured or its prior)."""
        seen = self.samples[-1].choice.get("bandwidth_bytes_per_s")
        return None if seen is None else round(seen / 1e6)

    def effective_x(self) -> float | None:
        if not self.whole:
            return None
        link_bytes_per_s = self.rate_gbit * 1e9 / 8
        return self.median("kv_bytes") / self.median("handoff_s") / link_bytes_per_s

    def row(self) -> list[Any]:
        cpu = [self.cpu_per_gib(side) for side in (0, 1)]
        return [self.rate_gbit, self.tokens, self.config, self.chosen(), self.seen_mb_s(),
                round(self.median("kv_bytes") / (1 << 20), 1),
                round(self.median("wire_bytes") / (1 << 20), 1),
                round(self.median("ttft_s"), 3), round(self.median("tt2t_s"), 3),
                round(self.median("handoff_s"), 3), _round(self.effective_x()),
                _round(cpu[0]), _round(cpu[1])]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# ---------------------------------------------------------------- the run


# A claim waits this long for its KV: a long prompt's prefill on loaded cores can exceed 30 s.
TRANSFER_TIMEOUT_S = 300


def transfer_toml(values: dict[str, Any]) -> str:
    values = {**values, "transfer_timeout_s": TRANSFER_TIMEOUT_S}
    lines = ["[transfer]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def start_nodes(nodes: NetnsNodes, model: str, configs: list[str]) -> dict[str, NetnsNode]:
    args = ["--model", model, "--prefix-cache-bytes", "0"]
    started = {"decode": nodes.start("decode", "decode", "decode", args, transfer_toml({}))}
    for name in configs:
        started[name] = nodes.start("prefill", "prefill", f"prefill-{name}", args,
                                    transfer_toml(CONFIGS[name]))
    nodes.wait_all(600)
    return started


async def run_config(nodes: NetnsNodes, started: dict[str, NetnsNode], config: str,
                     rate_gbit: float, lengths: list[int], repeats: int,
                     rng: random.Random) -> list[Case]:
    prefill, decode = started[config], started["decode"]
    cases = []
    with CpuSampler([prefill.process.pid, decode.process.pid]) as sampler:
        async with LinkDriver(nodes.secret, prefill.serving_bind, decode.serving_bind) as driver:
            tag = f"{rate_gbit:g}g-{config}"
            await one_request(driver, prefill, sampler, f"warm-{tag}", WARMUP_TOKENS, rng)
            for tokens in lengths:
                try:
                    samples = [await one_request(driver, prefill, sampler,
                                                 f"{tag}-{tokens}-{i}", tokens, rng)
                               for i in range(repeats)]
                except RuntimeError as exc:  # one failed case does not end the run
                    print(f"failed: {exc}", flush=True)
                    continue
                case = Case(rate_gbit, tokens, config, samples)
                print(dict(zip(COLUMNS, case.row(), strict=True)), flush=True)
                cases.append(case)
    return cases


def raw_rows(net: NetnsTopology, rate_gbit: float, sizes: list[int]) -> list[list[Any]]:
    rows = []
    for size in sizes:
        runs = [raw_transfer(net, size) for _ in range(2)]
        seconds = statistics.median(r["seconds"] for r in runs)
        rows.append([rate_gbit, round(size / (1 << 20), 1), round(seconds, 3),
                     round(size / seconds / (rate_gbit * 1e9 / 8), 2),
                     round(sum(r["send_cpu_s"] for r in runs) / (2 * size / GIB), 2),
                     round(sum(r["recv_cpu_s"] for r in runs) / (2 * size / GIB), 2)])
        print({"raw TCP": rows[-1]}, flush=True)
    return rows


def hidden_rows(cases: list[Case]) -> list[list[Any]]:
    by_key = {(c.rate_gbit, c.tokens, c.config): c for c in cases}
    rows = []
    for (rate, tokens, config), case in by_key.items():
        full = by_key.get((rate, tokens, "full-none"))
        if config == "streamed-none" and full is not None:
            hidden = 1 - case.median("handoff_s") / full.median("handoff_s")
            rows.append([rate, tokens, round(full.median("handoff_s"), 3),
                         round(case.median("handoff_s"), 3), round(100 * hidden, 1)])
    return rows


def run(model: str, rates: list[float], lengths: list[int], configs: list[str],
        repeats: int, workdir: Path) -> dict[str, Any]:
    rng = random.Random(0)
    cases: list[Case] = []
    raw: list[list[Any]] = []
    for rate in rates:  # fresh nodes per rate: no bandwidth estimate carries over
        with NetnsTopology(("prefill", "decode"), rate_bits_per_s=rate * 1e9) as net:
            nodes = NetnsNodes(net, workdir / f"{rate:g}gbit")
            try:
                started = start_nodes(nodes, model, configs)
                for config in configs:
                    cases += asyncio.run(run_config(nodes, started, config, rate, lengths,
                                                    repeats, rng))
            finally:
                nodes.stop_all()
            sizes = sorted({c.samples[0].kv_bytes for c in cases if c.rate_gbit == rate})
            raw += raw_rows(net, rate, sizes)
    return {"cases": cases, "raw": raw}


def report(found: dict[str, Any]) -> dict[str, Any]:
    cases = found["cases"]
    tables = [
        table("KV handoff over tbf-shaped links (median; eff x link = raw "
              "KV bytes / handoff s / link bytes/s; CPU per GiB of raw KV, full only)",
              COLUMNS, [c.row() for c in cases]),
        table("Bare link: raw TCP of the same bytes between the same namespaces",
              ["Gbit/s", "MiB", "seconds", "x link", "send CPU s/GiB", "recv CPU s/GiB"],
              found["raw"]),
        table("Streamed: transfer hidden behind prefill (codec none)",
              ["Gbit/s", "prompt", "full handoff s", "streamed handoff s", "hidden %"],
              hidden_rows(cases)),
    ]
    series = {"handoff_s": [c.median("handoff_s") for c in cases],
              "ttft_s": [c.median("ttft_s") for c in cases],
              "effective_x": [c.effective_x() or 0.0 for c in cases]}
    return bench_result("network", tables, series)


def main() -> None:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--rates", default="1,10", help="link rates, Gbit/s")
    parser.add_argument("--lengths", default="2048,8000", help="prompt tokens (< 8192)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--raw-sink", nargs=3, metavar=("HOST", "PORT", "BYTES"))
    parser.add_argument("--raw-send", nargs=3, metavar=("HOST", "PORT", "BYTES"))
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the nodes stop and the namespaces go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.raw_sink or args.raw_send:
        host, port, size = args.raw_sink or args.raw_send
        (raw_sink if args.raw_sink else raw_send)(host, int(port), int(size))
        return
    reason = unavailable_reason()
    if reason:
        print(f"bench_network skipped: {reason}")
        return
    from engines.model_store import ensure_default_model, ensure_tiny_model

    model = ensure_tiny_model() if args.quick else ensure_default_model()
    rates = [1.0] if args.quick else [float(r) for r in args.rates.split(",")]
    lengths = [1024] if args.quick else [int(n) for n in args.lengths.split(",")]
    configs = list(QUICK_CONFIGS) if args.quick else args.configs.split(",")
    repeats = 1 if args.quick else args.repeats
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-network-{os.getpid()}"
    found = run(str(model), rates, lengths, configs, repeats, workdir)
    result = report(found)
    for item in result["tables"]:
        print("\n" + format_table(item))
    if args.json:
        write_json(Path(args.json), result)


if __name__ == "__main__":
    main()
