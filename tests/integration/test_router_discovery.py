"""``--peers``: the router learns which nodes serve prefill and decode from their handshakes."""

from __future__ import annotations

import httpx
import pytest

from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LocalCluster, start_node
from tests.integration.test_router_cluster import MODEL, fake_model_dir

STARTUP_TIMEOUT_S = 120


@pytest.fixture
def nodes(tiny_model_path, tmp_path):
    model = fake_model_dir(tmp_path / "model", tiny_model_path)
    cluster = LocalCluster(tmp_path, model=model, prefill_count=0, decode_count=0,
                           common_args=["--engine", "fake", "--no-warmup",
                                        "--served-model-name", MODEL])  # fmt: skip
    generate_secret_file(cluster.secret_path)
    try:
        for role in ("decode", "prefill", "decode"):
            cluster.start_engine_node(role)
        for node in cluster.nodes:
            node.wait_healthy(STARTUP_TIMEOUT_S)
        yield cluster
    finally:
        cluster.stop()


def start_router(cluster: LocalCluster, *flags: str):
    router = start_node("router", cluster.workdir, [*cluster.node_args(), *flags])
    cluster.nodes.append(router)
    return router


def test_router_sorts_static_peers_into_pools_by_handshake_role(nodes: LocalCluster):
    peers = ",".join(node.serving_bind for node in nodes.nodes)
    router = start_router(nodes, "--peers", peers)
    router.wait_healthy(STARTUP_TIMEOUT_S)
    body = {"model": MODEL, "prompt": "discovery", "max_tokens": 4}
    reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30).json()
    assert reply["usage"]["completion_tokens"] == 4
    pools = httpx.get(f"{router.url}/router/stats", timeout=10).json()["nodes"]
    assert [e["id"] for e in pools["prefill"]] == ["prefill-0"]
    assert [e["id"] for e in pools["decode"]] == ["decode-0", "decode-1"]


def test_router_refuses_peers_without_a_decode_node(nodes: LocalCluster):
    prefill = next(node for node in nodes.nodes if node.role == "prefill")
    router = start_router(nodes, "--peers", prefill.serving_bind)
    assert router.process.wait(timeout=STARTUP_TIMEOUT_S) == 2
    last = router.log_tail().strip().splitlines()[-1]
    assert last == (
        "mlxcel-server: error: the router found no decode node among --peers and --decode-peers"
    )
