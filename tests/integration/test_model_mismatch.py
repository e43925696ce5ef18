"""A node serving another model is refused at its handshake, whatever found it.

Every node announces its checkpoint's digest in the link verdict; the router
compares it with its own before the node joins a pool (static flags here; the
discovery sources go through the same dialer). Real fake-engine processes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from mlxcel_plugin.local_cluster import LocalCluster
from mlxcel_plugin.testing.membership_harness import node_entry, router_stats, wait_until
from tests.integration.test_membership import (
    CHANGE_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    make_cluster,
    start_nodes,
    start_router,
)
from tests.integration.test_router_cluster import MODEL, fake_model_dir

pytestmark = pytest.mark.timeout(300)


def test_a_node_announcing_another_model_never_gets_traffic(tmp_path, tiny_model_path):
    cluster = make_cluster(tmp_path, tiny_model_path)
    other = LocalCluster(tmp_path / "other", common_args=cluster.common_args,
                         model=fake_model_dir(tmp_path / "other-model", tiny_model_path,
                                              decode_step_s=0.01))
    other.workdir.mkdir()
    shutil.copy(cluster.secret_path, other.secret_path)  # same cluster secret, other model
    config = Path(other.model, "config.json")
    config.write_text(config.read_text().replace("{", '{"variant": 2, ', 1))
    try:
        start_nodes(cluster, [("prefill", None), ("decode", None)])
        prefill, decode = cluster.nodes
        foreign = other.start_engine_node("decode")
        foreign.wait_healthy(STARTUP_TIMEOUT_S)
        router = start_router(cluster, "", "--prefill-peers", prefill.serving_bind,
                              "--decode-peers", f"{decode.serving_bind},{foreign.serving_bind}")
        for i in range(6):  # round-robin would give the foreign node every other request
            reply = httpx.post(f"{router.url}/v1/completions", timeout=30,
                               json={"model": MODEL, "prompt": f"mismatch {i}", "max_tokens": 2})
            assert reply.status_code == 200, reply.text
        wait_until(lambda: "model_mismatch" in str(router_stats(router.url)), CHANGE_TIMEOUT_S)
        entry = node_entry(router_stats(router.url), "decode", foreign.serving_bind)
        assert entry is not None and entry["health"] == "unreachable", entry
        assert entry["dispatched"] == 0, entry
        log = router.log_path.read_text()
        assert foreign.serving_bind in log and "serves model" in log
    finally:
        other.stop()
        cluster.stop()
