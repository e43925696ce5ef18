"""Faults under load: kill -9 / SIGSTOP of a node mid-stream, a rolling restart, and what
migration costs (docs/cluster-flow.md, "Migration").

A router in front of 2 prefill + 2 decode nodes on engine ``fake`` in its autoregressive mode
(``mlxcel_plugin/testing/fake_autoregressive.py``: a migrated stream has one right answer,
the no-fault one), ``--streams`` concurrent streamed completions. Per fault:

* completed / failed (as the clients saw them; a completed stream must also equal the no-fault
  text, else it counts as wrong), migrated / rerouted (the router's counters);
* gap p50/p99: over the streams that moved, their longest wait between two tokens — the
  latency a migration added, detection included;
* resume p50/p99: the router's own ``migration_resume`` (from the migration's start to the
  first continued token), against ``fresh TTFT``: the TTFT of the same number of fresh
  requests with the prompt + the tokens streamed so far, sent at once;
* unreachable_s: for SIGSTOP, from the signal until ``/router/stats`` says ``unreachable``.

Then a rolling restart: every worker in turn gets SIGTERM (exit awaited, then -9 after 30 s)
and is started again while ``--streams`` streams keep coming.

``--flips`` instead measures, in-process on a real model (``--model``, SmolLM2 by default),
how often re-prefilling prompt + generated tokens changes a greedy continuation.

Usage: python loadtests/bench_chaos.py [--quick] [--json PATH] [--streams 32]
       python loadtests/bench_chaos.py --flips [--prompts 30] [--model PATH] [--greedy-only]
       [--flip-tokens 64] [--flip-points 1,16,40]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import harness
import httpx
from bench_common import (
    StreamRecorder,
    add_common_args,
    bench_result,
    format_table,
    percentile,
    table,
    write_json,
    write_toml_config,
)

from mlxcel_plugin.local_cluster import LocalCluster, NodeProcess, start_node

MODEL = "tiny"
KNOBS = {"autoregressive": True, "decode_step_s": 0.01, "prefill_s_per_token": 0.0002}
PROMPT_WORDS = 256
FAULT_AT_TOKENS = 40  # "mid-stream": the median stream has this many tokens
GAP_FLOOR_S = 0.15  # a wait between tokens this long is a move, not a decode step


# ------------------------------------------------------------------ the cluster


def fake_model_dir(root: Path) -> str:
    """The tiny checkpoint's tokenizer (no weights) with the fake engine's knobs."""
    from engines.model_store import ensure_tiny_model

    tiny = ensure_tiny_model(root=Path(__file__).resolve().parents[1] / ".cache" / "mlxcel")
    return str(harness.fake_model_dir(root, tiny, KNOBS))


def start(workdir: Path) -> LocalCluster:
    flags = write_toml_config(workdir / "router.toml", {"router": {"token_timeout_s": 5.0}})
    args = ["--engine", "fake", "--served-model-name", MODEL, "--no-warmup",
            "--prefill-balancer", "round-robin", "--decode-balancer", "round-robin", *flags]
    cluster = LocalCluster(workdir=workdir, model=fake_model_dir(workdir / "model"),
                           prefill_count=2, decode_count=2, common_args=args)
    return cluster.start(180)


def router_stats(cluster: LocalCluster) -> dict:
    return httpx.get(f"{cluster.router.url}/router/stats", timeout=10).json()


def health_of(cluster: LocalCluster, node_id: str) -> str:
    entries = [e for role in router_stats(cluster)["nodes"].values() for e in role]
    return next(e["health"] for e in entries if e["id"] == node_id)


def wait_all_healthy(cluster: LocalCluster, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded by the deadline
        nodes = router_stats(cluster)["nodes"].values()
        if all(e["health"] == "healthy" for role in nodes for e in role):
            return
        time.sleep(0.1)
    raise TimeoutError("the pool did not recover")


def restart(cluster: LocalCluster, old: NodeProcess, exit_timeout_s: float = 0.0) -> None:
    """The same node again on the same serving bind; ``exit_timeout_s`` for a drain."""
    try:
        old.process.wait(exit_timeout_s)
    except subprocess.TimeoutExpired:
        old.process.kill()
        old.process.wait(10)
    index = cluster.nodes.index(old)
    cluster.nodes[index] = start_node(old.role, cluster.workdir, cluster.node_args(),
                                      serving_bind=old.serving_bind)
    cluster.nodes[index].wait_healthy(180)
    wait_all_healthy(cluster)


def node_named(cluster: LocalCluster, node_id: str) -> NodeProcess:
    role, index = node_id.split("-")
    return cluster.pool(role)[int(index)]


# ------------------------------------------------------------------ load


@dataclass
class Load:
    """``streams`` streamed completions at once; ``progress[i]`` = tokens stream i has seen."""

    url: str
    prompts: list[str]
    max_tokens: int
    progress: list[int] = field(default_factory=list)

    def run(self) -> list:
        self.progress = [0] * len(self.prompts)
        pool = ThreadPoolExecutor(len(self.prompts))
        futures = [pool.submit(self._one, i, p) for i, p in enumerate(self.prompts)]
        pool.shutdown(wait=False)
        return futures

    def median_progress(self) -> float:
        return percentile(self.progress, 50)

    def _one(self, index: int, prompt: str):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens,
                "stream": True, "temperature": 0.0}
        recorder, start_s = StreamRecorder(kind="completion"), time.perf_counter()
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body,
                              timeout=120) as response:
                for line in response.iter_lines():
                    recorder.feed(line, time.perf_counter() - start_s)
                    self.progress[index] = recorder.content_chunks
        except httpx.HTTPError as exc:
            recorder.error = f"{type(exc).__name__}: {exc}"
        return recorder.finish(time.perf_counter() - start_s)


def prompts_for(count: int, words: int, tag: str = "") -> list[str]:
    return [f"{'story ' * words}{tag}number {i}" for i in range(count)]


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():  # bounded by the deadline
        time.sleep(0.01)


# ------------------------------------------------------------------ one fault


@dataclass
class FaultResult:
    name: str
    completed: int
    wrong: int
    failed: int
    migrated: int
    rerouted: int
    gaps_s: list[float]
    unreachable_s: float | None = None

    def row(self) -> list:
        gap50, gap99 = (percentile(self.gaps_s, q) for q in (50, 99))
        unreachable = "-" if self.unreachable_s is None else f"{self.unreachable_s:.2f}"
        return [self.name, self.completed, self.wrong, self.failed, self.migrated,
                self.rerouted, f"{gap50:.3f}", f"{gap99:.3f}", unreachable]


def time_to_unreachable(cluster: LocalCluster, node_id: str, since_s: float) -> float | None:
    deadline = since_s + 30.0
    while time.monotonic() < deadline:  # bounded by the deadline
        if health_of(cluster, node_id) == "unreachable":
            return time.monotonic() - since_s
        time.sleep(0.02)
    return None


def run_fault(cluster: LocalCluster, load: Load, baseline: list[str], name: str,
              node_id: str | None, signum: int | None, at_tokens: int) -> FaultResult:
    before = router_stats(cluster)["metrics"]
    futures = load.run()
    wait_for(lambda: load.median_progress() >= at_tokens)
    unreachable_s = None
    if node_id is not None:
        os.kill(node_named(cluster, node_id).process.pid, signum)
        if signum == signal.SIGSTOP:
            unreachable_s = time_to_unreachable(cluster, node_id, time.monotonic())
    results = [f.result() for f in futures]
    recover(cluster, node_id, signum)
    after = router_stats(cluster)["metrics"]
    ok = [r for r in results if r.ok]
    wrong = sum(r.text != want for r, want in zip(results, baseline, strict=True) if r.ok)
    gaps = [max(r.itl_s) for r in ok if r.itl_s and max(r.itl_s) > GAP_FLOOR_S]
    return FaultResult(name, len(ok), wrong, len(results) - len(ok),
                       after["migrated"] - before["migrated"],
                       after["rerouted"] - before["rerouted"], gaps, unreachable_s)


def recover(cluster: LocalCluster, node_id: str | None, signum: int | None) -> None:
    if node_id is None:
        return
    node = node_named(cluster, node_id)
    if signum == signal.SIGSTOP:
        os.kill(node.process.pid, signal.SIGCONT)
        wait_all_healthy(cluster)
    else:
        restart(cluster, node)


def fresh_ttft(cluster: LocalCluster, count: int, words: int) -> float:
    """TTFT p50 of ``count`` fresh requests at once with ``words``-word prompts."""
    load = Load(cluster.router.url, prompts_for(count, words, "fresh "), 1)
    results = [f.result() for f in load.run()]
    return percentile([r.ttft_s for r in results if r.ok and r.ttft_s is not None], 50)


# ------------------------------------------------------------------ rolling restart


def rolling_restart(cluster: LocalCluster, load: Load, baseline: list[str]) -> FaultResult:
    before, results, stop = router_stats(cluster)["metrics"], [], threading.Event()

    def drive() -> None:
        while not stop.is_set():  # bounded: stopped after the last restart
            results.extend(zip((f.result() for f in load.run()), baseline, strict=True))

    driver = threading.Thread(target=drive)
    driver.start()
    for node_id in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        node = node_named(cluster, node_id)
        wait_for(lambda: load.median_progress() >= FAULT_AT_TOKENS // 2)
        os.kill(node.process.pid, signal.SIGTERM)
        restart(cluster, node, exit_timeout_s=30.0)
    stop.set()
    driver.join(300)
    after = router_stats(cluster)["metrics"]
    ok = [(r, want) for r, want in results if r.ok]
    gaps = [max(r.itl_s) for r, _ in ok if r.itl_s and max(r.itl_s) > GAP_FLOOR_S]
    return FaultResult("rolling restart x4 (SIGTERM)", len(ok),
                       sum(r.text != want for r, want in ok), len(results) - len(ok),
                       after["migrated"] - before["migrated"],
                       after["rerouted"] - before["rerouted"], gaps)


# ------------------------------------------------------------------ main


FAULTS = [  # name, node, signal, fire when the median stream has this many tokens
    ("kill -9 decode mid-stream", "decode-0", signal.SIGKILL, FAULT_AT_TOKENS),
    ("SIGSTOP decode mid-stream", "decode-0", signal.SIGSTOP, FAULT_AT_TOKENS),
    ("kill -9 prefill before 1st token", "prefill-0", signal.SIGKILL, 0),
    ("SIGSTOP prefill before 1st token", "prefill-0", signal.SIGSTOP, 0),
    ("kill -9 prefill mid-stream", "prefill-0", signal.SIGKILL, FAULT_AT_TOKENS),
]


def run_chaos(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        cluster = start(Path(tmp))
        try:
            return measure(cluster, args)
        finally:
            cluster.stop()


def measure(cluster: LocalCluster, args: argparse.Namespace) -> dict:
    load = Load(cluster.router.url, prompts_for(args.streams, PROMPT_WORDS), args.max_tokens)
    baseline_results = [f.result() for f in load.run()]
    baseline = [r.text for r in baseline_results]
    rows = [FaultResult("no fault", sum(r.ok for r in baseline_results), 0,
                        sum(not r.ok for r in baseline_results), 0, 0, []).row()]
    faults = FAULTS[:2] if args.quick else FAULTS
    for name, node_id, signum, at_tokens in faults:
        rows.append(run_fault(cluster, load, baseline, name, node_id, signum, at_tokens).row())
        print(rows[-1], flush=True)
    if not args.quick:
        rows.append(rolling_restart(cluster, load, baseline).row())
    metrics = router_stats(cluster)["metrics"]
    fresh = fresh_ttft(cluster, args.streams // 2, PROMPT_WORDS + FAULT_AT_TOKENS)
    return {"rows": rows, "resume_p50_s": metrics["migration_resume_p50_s"],
            "resume_p99_s": metrics["migration_resume_p99_s"], "fresh_ttft_p50_s": fresh}


def report(result: dict, args: argparse.Namespace) -> None:
    columns = ["fault", "completed", "wrong", "failed", "migrated", "rerouted",
               "gap p50 s", "gap p99 s", "unreachable s"]
    faults = table(f"{args.streams} streams, 2P+2D fake engine, {args.max_tokens} tokens",
                   columns, result["rows"])
    resume = table("migration resume vs fresh TTFT (same prompt length, same burst)",
                   ["resume p50 s", "resume p99 s", "fresh TTFT p50 s"],
                   [[result["resume_p50_s"], result["resume_p99_s"],
                     round(result["fresh_ttft_p50_s"], 4)]])
    for t in (faults, resume):
        print(format_table(t))
    if args.json:
        write_json(args.json, bench_result("chaos", [faults, resume], {}))


def main(argv: list[str] | None = None) -> int:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--flips", action="store_true", help="the token-flip measurement")
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--model", default=None)
    parser.add_argument("--flip-tokens", type=int, default=64)
    parser.add_argument("--flip-points", default="1,16,40", help="migration points k")
    parser.add_argument("--greedy-only", action="store_true")
    args = parser.parse_args(argv)
    if args.flips:
        from migration_flips import run_flips

        return run_flips(args)
    report(run_chaos(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
