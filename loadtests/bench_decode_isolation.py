"""Decode isolation: inter-token latency of running streams, alone and while long prompts arrive.

Hybrid: one engine process does both (a 2k-token prefill stalls every running
stream for its duration). Disaggregated: a prefill node and a decode node as
separate processes, driven over real links by ``LinkDriver`` (the router's
role, without its HTTP front: the figure is the decode node's, not the
router's); the long prompts' KV arrives at the decode node through ingestion,
which never blocks a decode step. Target: disaggregated p99 ITL under load
<= 1.25x unloaded, judged on the median of ``--runs`` (default 3) disaggregated runs,
each with fresh nodes (the ratio is noisy on a shared machine; every run is listed).

Separate machines, emulated: with ``--pin`` (the default on >= 2 cores) the
prefill node runs on one core and the decode node plus this driver on
another, each with ``OPENBLAS_NUM_THREADS=1``, so prefill work cannot steal
decode's CPU. Hybrid stays unpinned (a single node owns the whole machine) and
is also measured pinned to one core for reference. Not emulated: the two cores
still share caches, memory bandwidth and this machine's other tenants.

Window: ``--streams`` streams decode for ``--window-s`` from their first token
(then they are cancelled); only gaps inside the window count. Loaded, one long
prompt arrives every ``--long-interval-ms`` on a fixed schedule, not paced by
completions, so every mode gets the same number of long prompts in the same
window. Unloaded and loaded windows run in the same processes. Gaps are timed
where tokens arrive (here, the driver), as a client would see them.

    python loadtests/bench_decode_isolation.py [--quick] [--json PATH] [--model DIR]
        [--pin | --no-pin] [--long-interval-ms 500] [--window-s S] [--streams 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import add_common_args, bench_result, summarize, table, write_json  # noqa: E402
from harness import available_cores  # noqa: E402

from mlxcel_plugin import openblas  # noqa: E402
from mlxcel_plugin.link import generate_secret_file, load_cluster_secret  # noqa: E402
from mlxcel_plugin.local_cluster import (  # noqa: E402
    LOOPBACK,
    NodeProcess,
    free_port,
    pin_process,
    start_node,
)
from mlxcel_plugin.testing.link_driver import LinkDriver  # noqa: E402

LONG_PROMPT_TOKENS = 2000
TARGET_RATIO = 1.25
DISAGGREGATED = "disaggregated"


def stream_prompt(i: int) -> list[int]:
    return [(13 * j + i) % 4000 + 100 for j in range(32)]


def long_prompt(i: int) -> list[int]:
    return [(7 * j + 31 * i) % 4000 + 100 for j in range(LONG_PROMPT_TOKENS)]


def gaps(times: list[float], skip: int = 1) -> list[float]:
    """Gaps between token arrivals, after the first ``skip`` (joining the batch)."""
    times = times[skip:]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def window_gaps(times: list[float], end: float, skip: int = 1) -> list[float]:
    return gaps([t for t in times if t <= end], skip)


@dataclass(frozen=True)
class Phase:
    """One measured window: streams decode for ``window_s``; long prompts every ``interval_s``.

    The schedule is fixed in time, not paced by completions, so every mode gets
    the same arrival rate for the same window (``interval_s=None``: no load).
    """

    window_s: float
    interval_s: float | None = None

    @property
    def long_prompts(self) -> int:
        return math.ceil(self.window_s / self.interval_s) if self.interval_s else 0

    def due_s(self, k: int) -> float:
        return k * (self.interval_s or 0.0)


def phase_result(itl: list[float], sent: int, window_s: float) -> dict[str, Any]:
    return {"itl": itl, "long_prompts": sent, "window_s": window_s}


# ---------------------------------------------------------------- CPU placement


@dataclass(frozen=True)
class Placement:
    """Which cores each process may use (empty: not pinned)."""

    prefill: frozenset[int] = frozenset()
    decode: frozenset[int] = frozenset()
    hybrid_reference: frozenset[int] = frozenset()

    @property
    def pinned(self) -> bool:
        return bool(self.prefill)


def make_placement(pin: bool) -> Placement:
    cores = available_cores()
    if not pin or len(cores) < 2 or not hasattr(os, "sched_setaffinity"):
        return Placement()
    # Prefill on the first core, decode + driver on the second: two "machines".
    return Placement(frozenset(cores[:1]), frozenset(cores[1:2]), frozenset(cores[:1]))


def blas_env(cores: Collection[int]) -> dict[str, str]:
    """OpenBLAS preloaded, with one BLAS thread per core the process may use.

    More BLAS threads than cores make them preempt each other in every matmul.
    MLX itself computes on one thread per stream, so it needs no setting.
    """
    env = openblas.preload_env(os.environ) or dict(os.environ)
    env["OPENBLAS_NUM_THREADS"] = str(len(cores) or len(available_cores()))
    return env


def thread_cores(pid: int) -> set[int]:
    """Union of the cores every thread of ``pid`` may run on (checks the pinning held)."""
    cores: set[int] = set()
    if not hasattr(os, "sched_getaffinity") or not Path(f"/proc/{pid}/task").is_dir():
        return cores  # not Linux: nothing was pinned, nothing to check
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cores |= os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            continue
    return cores


def describe(cores: Collection[int]) -> str:
    return "cores " + ",".join(map(str, sorted(cores))) if cores else "unpinned"


# ---------------------------------------------------------------- hybrid (child process)


class HybridStreams:
    """The running streams of one phase inside the hybrid child: token times, finishes."""

    def __init__(self, engine: Any, count: int, tokens: int, tag: int):
        from mlxcel_plugin.engine_api import GenerationRequest

        self.times: list[list[float]] = [[] for _ in range(count)]
        self.ids = [f"s{tag}-{i}" for i in range(count)]
        self.first, self.all_done = threading.Event(), threading.Event()
        self._left, self._lock = count, threading.Lock()
        for i, request_id in enumerate(self.ids):
            request = GenerationRequest(request_id, tuple(stream_prompt(i)), tokens)
            engine.generate(request, self._emitter(i))

    def _emitter(self, i: int) -> Callable[[Any], None]:
        def emit(event: Any) -> None:
            if event.token_id is not None:
                self.times[i].append(time.perf_counter())
                self.first.set()
            if event.finish_reason is not None:
                self._finished()

        return emit

    def _finished(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.all_done.set()


def hybrid_phase(engine: Any, streams: int, tokens: int, phase: Phase) -> dict[str, Any]:
    """One measured window inside the hybrid child."""
    from mlxcel_plugin.engine_api import GenerationRequest

    tag, long_done = time.monotonic_ns(), threading.Semaphore(0)
    running = HybridStreams(engine, streams, tokens, tag)
    running.first.wait(60)
    start, sent = time.perf_counter(), 0
    for k in range(phase.long_prompts):
        if running.all_done.wait(max(0.0, start + phase.due_s(k) - time.perf_counter())):
            break
        request = GenerationRequest(f"long{tag}-{k}", tuple(long_prompt(k)), 2)
        engine.generate(request, lambda e: e.finish_reason and long_done.release())
        sent += 1
    running.all_done.wait(max(0.0, start + phase.window_s - time.perf_counter()))
    window_s = min(time.perf_counter() - start, phase.window_s)
    for request_id in running.ids:  # the window is over: free the batch for the next phase
        engine.cancel(request_id)
    running.all_done.wait(30)
    for _ in range(sent):  # queued long prompts drain before the next phase
        long_done.acquire(timeout=120)
    itl = [g for times in running.times for g in window_gaps(times, start + phase.window_s)]
    return phase_result(itl, sent, window_s)


def hybrid_child(model: str, streams: int, tokens: int, loaded: Phase) -> None:
    """Runs in its own process: prints {"unloaded": ..., "loaded": ...} as JSON."""
    from engines.mlx_engine import MlxEngine
    from mlxcel_plugin.engine_api import EngineConfig

    engine = MlxEngine.from_path(model, EngineConfig())
    engine.start()
    hybrid_phase(engine, 1, 4, Phase(5.0))  # first requests pay one-off compile costs
    phases = {
        "unloaded": hybrid_phase(engine, streams, tokens, Phase(loaded.window_s)),
        "loaded": hybrid_phase(engine, streams, tokens, loaded),
    }
    engine.close()
    print(json.dumps(phases))


def run_hybrid(
    model: str, streams: int, tokens: int, loaded: Phase, cores: Collection[int]
) -> dict[str, Any]:
    """Both phases in one hybrid child on ``cores`` (empty: every core of this machine)."""
    cores = cores or available_cores()
    args = [sys.executable, __file__, "--hybrid-child", "--model", model]
    args += ["--streams", str(streams), "--tokens", str(tokens)]
    args += ["--window-s", str(loaded.window_s), "--long-interval-ms", str(loaded.interval_s * 1e3)]
    env = blas_env(cores)
    child = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    pin_process(child.pid, cores)  # explicit: this process may itself be pinned
    try:
        out, err = child.communicate(timeout=900)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    if child.returncode != 0:
        raise RuntimeError(f"hybrid child exited {child.returncode}: {err[-1500:]}")
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- disaggregated


async def drive(driver: LinkDriver, streams: int, tokens: int, phase: Phase) -> dict[str, Any]:
    tag = time.monotonic_ns()
    collectors = [
        await driver.submit(f"s{tag}-{i}", stream_prompt(i), tokens) for i in range(streams)
    ]
    waits = asyncio.gather(*(driver.wait(c, 600) for c in collectors))
    await first_token(collectors)
    start = time.perf_counter()
    long_waits = await feed_long_prompts(driver, tag, phase, waits, start)
    await asyncio.wait([waits], timeout=max(0.0, start + phase.window_s - time.perf_counter()))
    window_s = min(time.perf_counter() - start, phase.window_s)
    await stop_streams(driver, collectors, waits)
    for outcome in await asyncio.gather(*long_waits):
        if not outcome.ok:
            raise RuntimeError(f"long prompt failed: {outcome}")
    end = start + phase.window_s
    # token_times_s[0] is the prefill node's token: decode gaps start after it.
    itl = [g for c in collectors for g in window_gaps(c.outcome.token_times_s[1:], end)]
    return phase_result(itl, len(long_waits), window_s)


async def first_token(collectors: list[Any], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(c.outcome.tokens for c in collectors) and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


async def feed_long_prompts(
    driver: LinkDriver, tag: int, phase: Phase, streams_done: asyncio.Future, start: float
) -> list[asyncio.Future]:
    """Submit long prompt k at ``phase.due_s(k)`` unless the streams ended; their waits."""
    waits = []
    for k in range(phase.long_prompts):
        delay = max(0.0, start + phase.due_s(k) - time.perf_counter())
        done, _ = await asyncio.wait([streams_done], timeout=delay)
        if done:
            break
        collector = await driver.submit(f"long{tag}-{k}", long_prompt(k), 2)
        waits.append(asyncio.ensure_future(driver.wait(collector, 120)))
    return waits


async def stop_streams(driver: LinkDriver, collectors: list[Any], waits: asyncio.Future) -> None:
    """Cancel streams still running after the window (the decode node sends nothing back)."""
    if waits.done():
        return
    for collector in collectors:
        if not collector.done.is_set():
            await driver.cancel(collector.outcome.request_id)
    waits.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waits


def start_pair(model: str, workdir: Path, placement: Placement) -> tuple[NodeProcess, NodeProcess]:
    secret_path = workdir / "cluster.secret"
    generate_secret_file(secret_path)
    common = ["--cluster-secret-file", str(secret_path), "--model", model]
    nodes = []
    for role, cores in (("decode", placement.decode), ("prefill", placement.prefill)):
        bind = f"{LOOPBACK}:{free_port()}"
        nodes.append(
            start_node(
                role, workdir, common, env=blas_env(cores), serving_bind=bind, cpu_affinity=cores
            )
        )
    return nodes[1], nodes[0]


def run_disaggregated(
    model: str, streams: int, tokens: int, loaded: Phase, placement: Placement
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-isolation-"))
    own_cores = available_cores()
    prefill, decode = start_pair(model, workdir, placement)
    try:
        decode.wait_healthy(300)
        prefill.wait_healthy(300)
        pin_process(os.getpid(), placement.decode)  # the driver sits with "its" decode node
        secret = load_cluster_secret(str(workdir / "cluster.secret"), {})

        async def both() -> dict[str, Any]:
            async with LinkDriver(secret, prefill.serving_bind, decode.serving_bind) as driver:
                await drive(driver, 1, 4, Phase(5.0))  # warm the links and the compile caches
                return {
                    "unloaded": await drive(driver, streams, tokens, Phase(loaded.window_s)),
                    "loaded": await drive(driver, streams, tokens, loaded),
                }

        phases = asyncio.run(both())
        phases["threads"] = {
            "prefill": sorted(thread_cores(prefill.process.pid)),
            "decode": sorted(thread_cores(decode.process.pid)),
        }
        return phases
    finally:
        pin_process(os.getpid(), own_cores)
        prefill.stop()
        decode.stop()


# ---------------------------------------------------------------- report


COLUMNS = [
    "mode",
    "placement",
    "phase",
    "long prompts",
    "window s",
    "gaps",
    "ITL p50 ms",
    "ITL p99 ms",
    "p99 / unloaded p99",
]
PLACEMENT_COLUMNS = ["process", "pinned to", "OPENBLAS_NUM_THREADS", "threads seen on"]


def mode_rows(mode: str, where: str, phases: dict[str, Any]) -> list[list[Any]]:
    base = summarize(phases["unloaded"]["itl"])["p99"]
    rows = []
    for phase in ("unloaded", "loaded"):
        run = phases[phase]
        stats = summarize(run["itl"])
        rows.append(
            [
                mode,
                where,
                phase,
                run["long_prompts"],
                round(run["window_s"], 2),
                int(stats["count"]),
                round(stats["p50"] * 1e3, 2),
                round(stats["p99"] * 1e3, 2),
                round(stats["p99"] / base, 2),
            ]
        )
    return rows


def placement_rows(placement: Placement, threads: dict[str, list[int]]) -> list[list[Any]]:
    blas = "1" if placement.pinned else str(len(available_cores()))
    rows = [
        ["prefill node", describe(placement.prefill), blas, describe(threads["prefill"])],
        ["decode node", describe(placement.decode), blas, describe(threads["decode"])],
        ["driver (this process)", describe(placement.decode), "-", "-"],
        ["hybrid node", describe(available_cores()), str(len(available_cores())), "-"],
    ]
    if placement.pinned:
        rows.append(["hybrid node (reference)", describe(placement.hybrid_reference), "1", "-"])
    return rows


def print_table(columns: list[str], rows: list[list[Any]]) -> None:
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(cell) for cell in row))


def pinning_json(placement: Placement, threads: dict[str, list[int]]) -> dict[str, Any]:
    return {
        "enabled": placement.pinned,
        "prefill": sorted(placement.prefill),
        "decode": sorted(placement.decode),
        "driver": sorted(placement.decode),
        "hybrid": available_cores(),
        "hybrid_reference": sorted(placement.hybrid_reference),
        "threads_seen": threads,
    }


def result_json(
    rows: list[list[Any]], ratios: dict[str, float], placement: Placement, threads: dict
) -> dict[str, Any]:
    tables = [
        table("ITL of running decode streams", COLUMNS, rows),
        table("CPU placement", PLACEMENT_COLUMNS, placement_rows(placement, threads)),
    ]
    series = {
        "p99_ratio": list(ratios.values()),
        "p99_unloaded_ms": [row[7] for row in rows[0::2]],
        "p99_loaded_ms": [row[7] for row in rows[1::2]],
    }
    legend = ", ".join(f"{i} = {mode}" for i, mode in enumerate(ratios))
    plot = {"y": ["p99_ratio"], "title": f"ITL p99 loaded / unloaded ({legend})"}
    result = bench_result("decode_isolation", tables, series, {**plot, "xlabel": "mode"})
    result["pinning"] = pinning_json(placement, threads)
    return result


def report(
    args: argparse.Namespace,
    loaded: Phase,
    placement: Placement,
    runs: dict[tuple[str, str], dict[str, Any]],
) -> None:
    threads = runs[next(key for key in runs if key[0].startswith(DISAGGREGATED))]["threads"]
    rows = [row for (mode, where), phases in runs.items() for row in mode_rows(mode, where, phases)]
    ratios = {row[0]: row[-1] for row in rows[1::2]}
    split = [ratio for mode, ratio in ratios.items() if mode.startswith(DISAGGREGATED)]
    print(
        f"decode isolation: {args.streams} streams (max {args.tokens} tokens) for "
        f"{loaded.window_s:g} s; one {LONG_PROMPT_TOKENS}-token prompt every "
        f"{loaded.interval_s * 1e3:.0f} ms while loaded; model {Path(args.model).name}, "
        f"{os.cpu_count()} cores, pinning {'on' if placement.pinned else 'off'}, "
        f"{len(split)} disaggregated run(s)"
    )
    print_table(PLACEMENT_COLUMNS, placement_rows(placement, threads))
    print_table(COLUMNS, rows)
    median = statistics.median(split)
    verdict = "meets" if median <= TARGET_RATIO else "misses"
    others = "; ".join(
        f"{mode} {ratio}x" for mode, ratio in ratios.items() if not mode.startswith(DISAGGREGATED)
    )
    print(
        f"disaggregated p99 under load / unloaded: runs {', '.join(f'{r}x' for r in split)}; "
        f"median {median}x ({verdict} the {TARGET_RATIO}x target); {others}"
    )
    if args.json:
        result = result_json(rows, ratios, placement, threads)
        result["disaggregated_ratios"], result["disaggregated_median"] = split, median
        write_json(args.json, result)


def parse_args() -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--model", help="mlx-lm checkpoint (default: the tiny test model)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument(
        "--tokens", type=int, default=2000, help="max tokens per stream (outlasts the window)"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin prefill and decode to separate cores (default: on with >= 2 cores)",
    )
    parser.add_argument(
        "--long-interval-ms",
        type=float,
        default=500.0,
        help="one long prompt every this many ms (a 2k prefill of the tiny model: ~370 ms)",
    )
    parser.add_argument(
        "--window-s", type=float, default=0.0, help="measured window (default 6, --quick 2.5)"
    )
    parser.add_argument(
        "--runs", type=int, default=3,
        help="disaggregated runs, each with fresh nodes; the verdict is on their median ratio",
    )
    parser.add_argument("--hybrid-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.model or default_model()
    args.window_s = args.window_s or (2.5 if args.quick else 6.0)
    return args


def main() -> None:
    args = parse_args()
    loaded = Phase(args.window_s, args.long_interval_ms / 1e3)
    if args.hybrid_child:
        hybrid_child(args.model, args.streams, args.tokens, loaded)
        return
    placement = make_placement(args.pin if args.pin is not None else len(available_cores()) >= 2)
    measure = (args.model, args.streams, args.tokens, loaded)
    runs = {("hybrid", describe(available_cores())): run_hybrid(*measure, ())}
    if placement.pinned:
        reference = placement.hybrid_reference
        runs[("hybrid (1 core, reference)", describe(reference))] = run_hybrid(*measure, reference)
    where = "unpinned"
    if placement.pinned:
        where = (
            f"prefill {describe(placement.prefill)}; decode + driver {describe(placement.decode)}"
        )
    count = 1 if args.quick else max(1, args.runs)
    for i in range(count):
        label = DISAGGREGATED if count == 1 else f"{DISAGGREGATED} {i + 1}/{count}"
        runs[(label, where)] = run_disaggregated(*measure, placement)
    report(args, loaded, placement, runs)


def default_model() -> str:
    from engines.model_store import ensure_tiny_model

    return str(ensure_tiny_model())


if __name__ == "__main__":
    main()
