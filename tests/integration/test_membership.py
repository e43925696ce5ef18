"""Nodes join and leave a running router (issue 20): peers file, DNS, mdns; real processes.

A bounded load (four clients, one request in flight each) runs throughout;
every request must succeed while a decode node joins or drains.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxcel_plugin.discovery_api import model_fingerprint
from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LocalCluster, NodeProcess, free_port, start_node
from mlxcel_plugin.testing.membership_harness import (
    BoundedLoad,
    node_entry,
    router_stats,
    wait_until,
    write_peers_file,
)
from tests.integration.test_router_cluster import MODEL, fake_model_dir
from tests.router_plugin.discovery.local_dns import LocalDns

STARTUP_TIMEOUT_S = 120
INTERVAL_S = 0.5
CHANGE_TIMEOUT_S = 30
DECODE_STEP_S = 0.02  # 16 tokens: a request stays in flight ~0.3 s, so drains have work
pytestmark = pytest.mark.timeout(600)


def start_nodes(cluster: LocalCluster, binds: list[tuple[str, str | None]]) -> None:
    for role, bind in binds:
        cluster.start_engine_node(role, bind)
    for node in cluster.nodes:
        node.wait_healthy(STARTUP_TIMEOUT_S)


def make_cluster(tmp_path: Path, tiny: Path, *extra: str,
                 decode_step_s: float = DECODE_STEP_S) -> LocalCluster:
    model = fake_model_dir(tmp_path / "model", tiny, decode_step_s=decode_step_s)
    cluster = LocalCluster(tmp_path, model=model, prefill_count=0, decode_count=0,
                           common_args=["--engine", "fake", "--no-warmup",
                                        "--served-model-name", MODEL, *extra])  # fmt: skip
    generate_secret_file(cluster.secret_path)
    return cluster


def start_router(cluster: LocalCluster, toml: str, *flags: str) -> NodeProcess:
    config = cluster.workdir / "router.toml"
    config.write_text(f"[discovery]\ninterval_s = {INTERVAL_S}\n{toml}")
    args = [*cluster.node_args(), "--distributed-config", str(config),
            "--prefill-balancer", "round-robin", "--decode-balancer", "round-robin", *flags]
    router = start_node("router", cluster.workdir, args, env={"MLXCEL_ROUTER_STATS_VERBOSE": "1"})
    cluster.nodes.append(router)
    router.wait_healthy(STARTUP_TIMEOUT_S)
    return router


def dispatched(router: NodeProcess, role: str, address: str) -> int:
    entry = node_entry(router_stats(router.url), role, address)
    return 0 if entry is None else entry["dispatched"]


def watch_drain(router: NodeProcess, address: str) -> tuple[float, list[dict]]:
    """Seconds until the decode node at ``address`` left the pool; its entries meanwhile."""
    seen: list[dict] = []

    def gone() -> bool:
        entry = node_entry(router_stats(router.url), "decode", address)
        if entry is not None:
            seen.append(entry)
        return entry is None

    return wait_until(gone, CHANGE_TIMEOUT_S), seen


def assert_drained_cleanly(seen: list[dict]) -> None:
    """Once draining, the node got no new request (its dispatch count stood still)."""
    draining = [e["dispatched"] for e in seen if e["health"] == "draining"]
    assert len(set(draining)) <= 1, f"dispatched while draining: {draining}"


@pytest.fixture
def file_cluster(tmp_path, tiny_model_path) -> Iterator[LocalCluster]:
    cluster = make_cluster(tmp_path, tiny_model_path)
    try:
        start_nodes(cluster, [("prefill", None), ("decode", None), ("decode", None)])
        yield cluster
    finally:
        cluster.stop()


def test_a_decode_node_added_to_the_peers_file_gets_traffic_and_leaves_by_draining(
        file_cluster: LocalCluster):
    prefill, first, second = (n.serving_bind for n in file_cluster.nodes)
    peers = file_cluster.workdir / "peers.toml"
    write_peers_file(peers, [prefill], [first])
    router = start_router(file_cluster, "", "--peers-file", str(peers))
    load = BoundedLoad(router.url, MODEL).start()
    try:
        wait_until(lambda: load.ok >= 4, CHANGE_TIMEOUT_S)
        write_peers_file(peers, [prefill], [first, second])
        to_traffic_s = wait_until(lambda: dispatched(router, "decode", second) > 0,
                                  CHANGE_TIMEOUT_S)
        wait_until(lambda: dispatched(router, "decode", second) >= 4, CHANGE_TIMEOUT_S)
        write_peers_file(peers, [prefill], [first])
        drain_s, seen = watch_drain(router, second)
        ok_before_stop = load.ok
        wait_until(lambda: load.ok >= ok_before_stop + 4, CHANGE_TIMEOUT_S)  # still serving
    finally:
        load.stop()
    assert load.failures == []
    assert to_traffic_s <= INTERVAL_S + 1.0, f"first traffic after {to_traffic_s:.2f}s"
    assert_drained_cleanly(seen)
    assert file_cluster.nodes[2].process.poll() is None  # drained, not killed
    changes = router_stats(router.url)["membership"]["changes"]
    assert changes == {"prefill_joined": 1, "decode_joined": 2, "decode_draining": 1,
                       "decode_left": 1}
    print(f"peers file: first traffic {to_traffic_s:.2f}s, drain {drain_s:.2f}s")


def test_a_node_with_another_models_fingerprint_is_refused_with_one_log_line(
        file_cluster: LocalCluster, tmp_path):
    prefill, first, second = (n.serving_bind for n in file_cluster.nodes)
    other = tmp_path / "other-model"
    shutil.copytree(file_cluster.model, other)
    config = (other / "config.json").read_text().replace("{", '{"num_hidden_layers_x": 3, ', 1)
    (other / "config.json").write_text(config)
    foreign = {"address": second, "fingerprint": model_fingerprint(other)}
    peers = file_cluster.workdir / "peers.toml"
    write_peers_file(peers, [prefill], [first, foreign])
    router = start_router(file_cluster, "", "--peers-file", str(peers))
    reply = httpx.post(f"{router.url}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert reply.status_code == 200
    lines = [line for line in router.log_path.read_text().splitlines() if "refusing" in line]
    assert len(lines) == 1 and second in lines[0] and "model fingerprint" in lines[0], lines
    assert node_entry(router_stats(router.url), "decode", second) is None


def test_a_listed_node_without_the_cluster_secret_never_gets_traffic(
        file_cluster: LocalCluster, tmp_path):
    prefill, first, _ = (n.serving_bind for n in file_cluster.nodes)
    stranger = LocalCluster(tmp_path / "stranger", model=file_cluster.model,
                            common_args=file_cluster.common_args)
    stranger.workdir.mkdir()
    generate_secret_file(stranger.secret_path)  # another cluster's secret
    try:
        outsider = stranger.start_engine_node("decode")
        outsider.wait_healthy(STARTUP_TIMEOUT_S)
        peers = file_cluster.workdir / "peers.toml"
        write_peers_file(peers, [prefill], [first, outsider.serving_bind])
        router = start_router(file_cluster, "", "--peers-file", str(peers))

        def refused() -> bool:
            entry = node_entry(router_stats(router.url), "decode", outsider.serving_bind)
            return entry is not None and entry["total_failures"] > 0

        wait_until(refused, CHANGE_TIMEOUT_S)
        for _ in range(4):
            reply = httpx.post(f"{router.url}/v1/completions", timeout=30,
                               json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert reply.status_code == 200
        entry = node_entry(router_stats(router.url), "decode", outsider.serving_bind)
        assert entry["health"] == "unreachable" and entry["dispatched"] == 0
        assert entry["last_error"].startswith("handshake"), entry["last_error"]  # bad MAC
    finally:
        stranger.stop()


def test_sighup_makes_the_router_reread_the_peers_file_at_once(file_cluster: LocalCluster):
    prefill, first, second = (n.serving_bind for n in file_cluster.nodes)
    peers = file_cluster.workdir / "peers.toml"
    write_peers_file(peers, [prefill], [first])
    config = file_cluster.workdir / "slow.toml"
    config.write_text("[discovery]\ninterval_s = 3600\n")  # only the signal re-reads it
    args = [*file_cluster.node_args(), "--distributed-config", str(config),
            "--peers-file", str(peers)]
    router = start_node("router", file_cluster.workdir, args,
                        env={"MLXCEL_ROUTER_STATS_VERBOSE": "1"})
    file_cluster.nodes.append(router)
    router.wait_healthy(STARTUP_TIMEOUT_S)
    write_peers_file(peers, [prefill], [first, second])
    router.process.send_signal(signal.SIGHUP)
    wait_until(lambda: node_entry(router_stats(router.url), "decode", second) is not None,
               CHANGE_TIMEOUT_S)
    assert router.process.poll() is None  # SIGHUP re-reads; it does not stop the router


def test_dns_names_follow_their_records_under_load(tmp_path, tiny_model_path):
    port = free_port()  # one port, several addresses: as a headless Service's pods
    a, b = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
    cluster = make_cluster(tmp_path, tiny_model_path)
    with LocalDns() as dns:
        try:
            start_nodes(cluster, [("prefill", None), ("decode", a), ("decode", b)])
            prefill = cluster.nodes[0].serving_bind
            dns.set("decode.mlxcel.test", "127.0.0.2")
            router = start_router(cluster, f'nameservers = ["{dns.nameserver}"]\n',
                                  "--prefill-peers", prefill,
                                  "--decode-peers", f"dns:decode.mlxcel.test:{port}")
            load = BoundedLoad(router.url, MODEL).start()
            try:
                wait_until(lambda: load.ok >= 4, CHANGE_TIMEOUT_S)
                dns.set("decode.mlxcel.test", "127.0.0.2", "127.0.0.3")
                to_traffic_s = wait_until(lambda: dispatched(router, "decode", b) > 0,
                                          CHANGE_TIMEOUT_S)
                dns.set("decode.mlxcel.test", "127.0.0.3")
                drain_s, seen = watch_drain(router, a)
            finally:
                load.stop()
        finally:
            cluster.stop()
    assert load.failures == []
    assert to_traffic_s <= INTERVAL_S + 1.0, f"first traffic after {to_traffic_s:.2f}s"
    assert_drained_cleanly(seen)
    print(f"dns: first traffic {to_traffic_s:.2f}s, drain {drain_s:.2f}s")


def multicast_unavailable() -> str | None:
    """Why mdns cannot work here (None when a service this process announces is seen)."""
    import asyncio

    from zeroconf import ServiceInfo
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    kind = "_mlxcel-probe._tcp.local."

    async def probe() -> bool:
        announcer, browser = AsyncZeroconf(), AsyncZeroconf()
        info = ServiceInfo(kind, f"probe-{free_port()}.{kind}", port=9,
                           parsed_addresses=["127.0.0.1"], server="probe.local.")
        try:
            await announcer.async_register_service(info)
            found = AsyncServiceInfo(kind, info.name)
            return await found.async_request(browser.zeroconf, 3000)
        finally:
            await announcer.async_close()
            await browser.async_close()

    try:
        return None if asyncio.run(probe()) else "multicast unavailable: no mdns answer"
    except OSError as exc:
        return f"multicast unavailable: {exc}"


def test_mdns_nodes_are_found_and_another_model_is_refused(tmp_path, tiny_model_path):
    reason = multicast_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = make_cluster(tmp_path, tiny_model_path, "--advertise", "mdns")
    other = LocalCluster(tmp_path / "other", common_args=cluster.common_args,
                         model=fake_model_dir(tmp_path / "other-model", tiny_model_path,
                                              decode_step_s=0.01))
    other.workdir.mkdir()
    shutil.copy(cluster.secret_path, other.secret_path)
    try:
        start_nodes(cluster, [("prefill", None), ("decode", None)])
        config = Path(other.model, "config.json")  # another checkpoint: its fingerprint differs
        config.write_text(config.read_text().replace("{", '{"variant": 2, ', 1))
        foreign = other.start_engine_node("decode")
        foreign.wait_healthy(STARTUP_TIMEOUT_S)
        router = start_router(cluster, "", "--discovery", "mdns")
        reply = httpx.post(f"{router.url}/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "mdns", "max_tokens": 2})
        assert reply.status_code == 200
        wait_until(lambda: "refusing" in router.log_path.read_text(), CHANGE_TIMEOUT_S)
        pools = router_stats(router.url)["nodes"]
        assert [e["address"] for e in pools["decode"]] == [cluster.nodes[1].serving_bind]
        lines = [line for line in router.log_path.read_text().splitlines() if "refusing" in line]
        assert len(lines) == 1 and foreign.serving_bind in lines[0], lines
    finally:
        other.stop()
        cluster.stop()
