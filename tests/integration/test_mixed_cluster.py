"""Mixed clusters (issue 34): incompatible nodes are refused before traffic; nothing fails.

Real processes (fake engine): one prefill node, one compatible decode node,
and decode nodes that cannot serve this cluster although their ``config.json``
is the router's: another layer count (``fake_engine.json``), another tokenizer,
another ``kv_bits``. Each announces its profile in its link verdict; the router
must never pair the prefill node with them. A streaming load of 200 requests
runs; every request must succeed, the incompatible nodes must see no handoff,
and each refusal must show in ``/router/stats``, in ``/metrics`` and in one log
line. Then the same with the incompatible node arriving later: in the peers file, and
as a new address of a DNS name (a local dnslib server).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mlxcel_plugin.local_cluster import LocalCluster, NodeProcess, free_port
from mlxcel_plugin.testing.membership_harness import (
    node_entry,
    router_stats,
    wait_until,
    write_peers_file,
)
from tests.integration.test_membership import (
    CHANGE_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    make_cluster,
    start_nodes,
    start_router,
)
from tests.integration.test_router_cluster import MODEL, fake_model_dir
from tests.router_plugin.discovery.local_dns import LocalDns

pytestmark = pytest.mark.timeout(600)

LOAD_REQUESTS = 200
LOAD_WORKERS = 4
LOAD_DEADLINE_S = 240.0
REQUEST_TIMEOUT_S = 30.0
# The compatible nodes' decode step: what is checked is where 200 streams go, not how long
# each takes (the membership tests' 20 ms step made the load ~12 s of sleeping per test).
LOAD_STEP_S = 0.005


class StreamingLoad:
    """``LOAD_REQUESTS`` streamed completions, ``LOAD_WORKERS`` at a time, bounded in time."""

    def __init__(self, url: str, requests: int = LOAD_REQUESTS):
        self.url, self.requests = url, requests
        self.ok, self.failures = 0, []
        self.deadline = time.monotonic() + LOAD_DEADLINE_S
        self._lock = threading.Lock()

    def run(self) -> StreamingLoad:
        with ThreadPoolExecutor(LOAD_WORKERS) as pool:
            list(pool.map(self._one, range(self.requests)))
        return self

    def _one(self, i: int) -> None:
        if time.monotonic() > self.deadline:
            error = "not started: the load's deadline passed"
        else:
            error = self._stream(i)
        with self._lock:
            if error:
                self.failures.append(error)
            else:
                self.ok += 1

    def _stream(self, i: int) -> str:
        body = {"model": MODEL, "prompt": f"mixed cluster request {i}", "max_tokens": 8,
                "stream": True}
        text, done = "", False
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body,
                              timeout=REQUEST_TIMEOUT_S) as reply:
                if reply.status_code != 200:
                    return f"{reply.status_code}: {reply.read()[:200]!r}"
                for line in reply.iter_lines():
                    data = line.removeprefix("data: ").strip()
                    if data == "[DONE]":
                        done = True
                    elif data:
                        chunk = json.loads(data)
                        if "error" in chunk:
                            return f"error chunk: {chunk['error']}"
                        text += "".join(c.get("text", "") for c in chunk.get("choices", []))
        except (httpx.HTTPError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "" if done and text else f"incomplete stream (done={done}, text={text!r})"


def foreign_node(tmp_path: Path, cluster: LocalCluster, name: str, tiny: Path, *,
                 toml: str = "", bind: str | None = None, **knobs: float) -> NodeProcess:
    """A decode node whose config.json is the cluster's, with one difference of its own."""
    other = LocalCluster(tmp_path / name, common_args=list(cluster.common_args),
                         model=fake_model_dir(tmp_path / f"{name}-model", tiny,
                                              decode_step_s=0.02, **knobs))
    other.workdir.mkdir()
    shutil.copy(cluster.secret_path, other.secret_path)
    if toml:
        config = other.workdir / "node.toml"
        config.write_text(toml)
        other.common_args += ["--distributed-config", str(config)]
    if name == "tokenizer":
        path = Path(other.model, "tokenizer.json")
        path.write_text(path.read_text().replace("{", '{"variant": 2, ', 1))
    node = other.start_engine_node("decode", bind)
    cluster.nodes.append(node)  # stopped with the cluster
    return node


def metric_lines(url: str, prefix: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def assert_refused_without_traffic(router: NodeProcess, node: NodeProcess, reason: str) -> None:
    entry = node_entry(router_stats(router.url), "decode", node.serving_bind)
    assert entry is not None, f"{node.serving_bind} not in the pool"
    assert entry["dispatched"] == 0 and entry["pairs"] == [], entry
    assert reason in [r["reason"] for r in entry["refused"]], entry
    assert entry["kv"], entry  # its fingerprint summary
    handoffs = {name: value for name, value in metric_lines(node.url, "mlxcel:kv_handoff").items()
                if "_total" in name}  # received and refused
    assert handoffs and all(value == 0 for value in handoffs.values()), handoffs
    # One line per newly refused pair, written when the second of its two profiles arrives:
    # it names this node as the one refused, or as the partner of the prefill node refused.
    node_id = entry["id"]
    log = router.log_path.read_text()
    lines = [line for line in log.splitlines() if "refusing " in line
             and (f"refusing {node_id} " in line or f"{node_id}: {reason}" in line)]
    assert len(lines) == 1 and reason in lines[0], lines


def assert_counted(router: NodeProcess, reasons: dict[str, int]) -> None:
    counts = metric_lines(router.url, "mlxcel:router_pair_refusals_total")
    assert counts == {f'mlxcel:router_pair_refusals_total{{reason="{reason}"}}': float(n)
                      for reason, n in reasons.items()}, counts


def test_incompatible_decode_nodes_never_get_a_handoff_under_load(tmp_path, tiny_model_path):
    cluster = make_cluster(tmp_path, tiny_model_path, decode_step_s=LOAD_STEP_S)
    try:
        start_nodes(cluster, [("prefill", None), ("decode", None)])
        prefill, decode = cluster.nodes
        foreign = {
            "layer_count_mismatch": foreign_node(tmp_path, cluster, "layers", tiny_model_path,
                                                 num_layers=6),
            "tokenizer_mismatch": foreign_node(tmp_path, cluster, "tokenizer", tiny_model_path),
            "kv_bits_mismatch": foreign_node(tmp_path, cluster, "kvbits", tiny_model_path,
                                             toml="[engine]\nkv_bits = 8\n"),
        }
        for node in foreign.values():
            node.wait_healthy(STARTUP_TIMEOUT_S)
        decodes = ",".join(n.serving_bind for n in (decode, *foreign.values()))
        router = start_router(cluster, "", "--prefill-peers", prefill.serving_bind,
                              "--decode-peers", decodes)
        wait_until(lambda: all(e["health"] == "healthy" for role in
                               router_stats(router.url)["nodes"].values() for e in role),
                   CHANGE_TIMEOUT_S)
        load = StreamingLoad(router.url).run()
        assert load.failures == [] and load.ok == LOAD_REQUESTS
        for reason, node in foreign.items():
            assert_refused_without_traffic(router, node, reason)
        assert_counted(router, dict.fromkeys(foreign, 1))
        metrics = router_stats(router.url)["metrics"]
        assert metrics["failed"] == 0 and metrics["refused_handoffs"] == {}
        print(f"\nmixed cluster load: {load.ok} ok, {len(load.failures)} failed, "
              f"handoffs to incompatible nodes: 0, pair refusals {metrics['pair_refusals']}")
    finally:
        cluster.stop()


def test_an_incompatible_node_arriving_through_the_peers_file_is_refused(
        tmp_path, tiny_model_path):
    cluster = make_cluster(tmp_path, tiny_model_path, decode_step_s=LOAD_STEP_S)
    try:
        start_nodes(cluster, [("prefill", None), ("decode", None)])
        prefill, decode = (n.serving_bind for n in cluster.nodes)
        late = foreign_node(tmp_path, cluster, "layers", tiny_model_path, num_layers=6)
        late.wait_healthy(STARTUP_TIMEOUT_S)
        peers = cluster.workdir / "peers.toml"
        write_peers_file(peers, [prefill], [decode])
        router = start_router(cluster, "", "--peers-file", str(peers))
        first = StreamingLoad(router.url, LOAD_REQUESTS // 4).run()
        write_peers_file(peers, [prefill], [decode, late.serving_bind])
        wait_until(lambda: (node_entry(router_stats(router.url), "decode", late.serving_bind)
                            or {}).get("refused"), CHANGE_TIMEOUT_S)
        rest = StreamingLoad(router.url, LOAD_REQUESTS - first.requests).run()
        assert first.failures == [] and rest.failures == []
        assert first.ok + rest.ok == LOAD_REQUESTS
        assert_refused_without_traffic(router, late, "layer_count_mismatch")
        assert_counted(router, {"layer_count_mismatch": 1})
    finally:
        cluster.stop()


def test_an_incompatible_node_arriving_through_dns_is_refused(tmp_path, tiny_model_path):
    port, name = free_port(), "decode.mixed.test"  # one port, several addresses
    cluster = make_cluster(tmp_path, tiny_model_path, decode_step_s=LOAD_STEP_S)
    with LocalDns() as dns:
        try:
            start_nodes(cluster, [("prefill", None), ("decode", f"127.0.0.2:{port}")])
            late = foreign_node(tmp_path, cluster, "layers", tiny_model_path,
                                bind=f"127.0.0.3:{port}", num_layers=6)
            late.wait_healthy(STARTUP_TIMEOUT_S)
            dns.set(name, "127.0.0.2")
            router = start_router(cluster, f'nameservers = ["{dns.nameserver}"]\n',
                                  "--prefill-peers", cluster.nodes[0].serving_bind,
                                  "--decode-peers", f"dns:{name}:{port}")
            first = StreamingLoad(router.url, LOAD_REQUESTS // 4).run()
            dns.set(name, "127.0.0.2", "127.0.0.3")
            wait_until(lambda: (node_entry(router_stats(router.url), "decode", late.serving_bind)
                                or {}).get("refused"), CHANGE_TIMEOUT_S)
            rest = StreamingLoad(router.url, LOAD_REQUESTS - first.requests).run()
            assert first.failures == [] and rest.failures == []
            assert first.ok + rest.ok == LOAD_REQUESTS
            assert_refused_without_traffic(router, late, "layer_count_mismatch")
            assert_counted(router, {"layer_count_mismatch": 1})
        finally:
            cluster.stop()
