"""Time from a membership change to first traffic, and to a finished drain (issue 20).

A router over 1 prefill + 2 decode ``fake``-engine nodes on 127.0.0.1, under a
bounded load (``--workers`` clients, one request in flight each). Each try adds
the second decode node (to the peers file, or to the DNS name's records) and
times until the router dispatched a request to it; then removes it and times
until it left the pool (draining done: its in-flight requests finished). Every
request must succeed. Prints p50/min/max over ``--tries`` per source.

    .venv/bin/python loadtests/bench_membership.py --tries 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlxcel_plugin.link import generate_secret_file  # noqa: E402
from mlxcel_plugin.local_cluster import LocalCluster, free_port, start_node  # noqa: E402
from mlxcel_plugin.testing.membership_harness import (  # noqa: E402
    BoundedLoad,
    node_entry,
    router_stats,
    wait_until,
    write_peers_file,
)
from tests.integration.test_router_cluster import fake_model_dir  # noqa: E402
from tests.router_plugin.discovery.local_dns import LocalDns  # noqa: E402

MODEL = "tiny"
TIMEOUT_S = 60


def tiny_model() -> Path:
    from engines.model_store import ensure_tiny_model
    from tests.conftest import model_cache_root

    return ensure_tiny_model(root=model_cache_root())


def dispatched(url: str, address: str) -> int:
    entry = node_entry(router_stats(url), "decode", address)
    return 0 if entry is None else entry["dispatched"]


def one_try(url: str, address: str, add: Callable[[], None],
            remove: Callable[[], None]) -> tuple[float, float]:
    before = dispatched(url, address)  # 0: the node left the pool after the last try
    add()
    to_traffic_s = wait_until(lambda: dispatched(url, address) > before, TIMEOUT_S, 0.01)
    wait_until(lambda: dispatched(url, address) >= 3, TIMEOUT_S, 0.01)  # work to drain
    remove()
    drain_s = wait_until(lambda: node_entry(router_stats(url), "decode", address) is None,
                         TIMEOUT_S, 0.01)
    return to_traffic_s, drain_s


def start_cluster(workdir: Path, binds: list[str | None], interval_s: float,
                  router_flags: Callable[[str], list[str]], toml: str = "") -> LocalCluster:
    """The nodes, then a router; ``router_flags(prefill_bind)`` are its peer flags."""
    model = fake_model_dir(workdir / "model", tiny_model(), decode_step_s=0.02)
    cluster = LocalCluster(workdir, model=model, prefill_count=0, decode_count=0,
                           common_args=["--engine", "fake", "--no-warmup",
                                        "--served-model-name", MODEL])  # fmt: skip
    generate_secret_file(cluster.secret_path)
    cluster.start_engine_node("prefill")
    for bind in binds:
        cluster.start_engine_node("decode", bind)
    for node in cluster.nodes:
        node.wait_healthy(TIMEOUT_S)
    config = workdir / "router.toml"
    config.write_text(f"[discovery]\ninterval_s = {interval_s}\n{toml}")
    args = [*cluster.node_args(), "--distributed-config", str(config),
            "--decode-balancer", "round-robin", *router_flags(cluster.nodes[0].serving_bind)]
    router = start_node("router", workdir, args, env={"MLXCEL_ROUTER_STATS_VERBOSE": "1"})
    cluster.nodes.append(router)
    return cluster


def run_tries(cluster: LocalCluster, address: str, add, remove, tries: int, workers: int):
    router = cluster.router
    router.wait_healthy(TIMEOUT_S)
    load = BoundedLoad(router.url, MODEL, workers=workers).start()
    try:
        wait_until(lambda: load.ok >= workers, TIMEOUT_S)
        results = [one_try(router.url, address, add, remove) for _ in range(tries)]
    finally:
        load.stop()
    return results, load


def bench_file(workdir: Path, args) -> tuple[list, BoundedLoad]:
    peers = workdir / "peers.toml"
    cluster = start_cluster(workdir, [None, None], args.interval_s,
                            lambda _: ["--peers-file", str(peers)])
    try:
        prefill, first, second = (n.serving_bind for n in cluster.nodes[:3])
        write_peers_file(peers, [prefill], [first])
        return run_tries(cluster, second,
                         lambda: write_peers_file(peers, [prefill], [first, second]),
                         lambda: write_peers_file(peers, [prefill], [first]),
                         args.tries, args.workers)
    finally:
        cluster.stop()


def bench_dns(workdir: Path, args) -> tuple[list, BoundedLoad]:
    port, name = free_port(), "decode.bench.test"
    with LocalDns() as dns:
        dns.set(name, "127.0.0.2")
        cluster = start_cluster(
            workdir, [f"127.0.0.2:{port}", f"127.0.0.3:{port}"], args.interval_s,
            lambda prefill: ["--decode-peers", f"dns:{name}:{port}", "--prefill-peers", prefill],
            f'nameservers = ["{dns.nameserver}"]\n')
        try:
            return run_tries(cluster, f"127.0.0.3:{port}",
                             lambda: dns.set(name, "127.0.0.2", "127.0.0.3"),
                             lambda: dns.set(name, "127.0.0.2"), args.tries, args.workers)
        finally:
            cluster.stop()


def report(source: str, results: list[tuple[float, float]], load: BoundedLoad) -> None:
    for label, values in (("first traffic", [r[0] for r in results]),
                          ("drain done", [r[1] for r in results])):
        print(f"{source:5} {label:14} p50 {statistics.median(values):6.2f}s  "
              f"min {min(values):5.2f}s  max {max(values):5.2f}s  (n={len(values)})")
    print(f"{source:5} requests ok {load.ok}, failed {len(load.failures)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--sources", default="file,dns")
    args = parser.parse_args()
    print(f"interval_s {args.interval_s}, {args.workers} clients, {args.tries} tries")
    failed = 0
    for source in args.sources.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            bench = bench_file if source == "file" else bench_dns
            results, load = bench(Path(tmp), args)
        report(source, results, load)
        failed += len(load.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
