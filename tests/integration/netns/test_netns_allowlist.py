"""The decode allowlist and the nodes' binds with real, non-loopback addresses.

Prefill, an allowed decode node and a refused one each sit in their own network
namespace (1 Gbit/s links); this process plays the router from the root
namespace over the bridge. Fake engine: the point is the addresses, not the model.
"""

from __future__ import annotations

import asyncio
import ipaddress
import subprocess
from collections.abc import Iterator

import pytest

from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.testing.fake_engine import expected_tokens
from mlxcel_plugin.testing.link_driver import LinkDriver
from mlxcel_plugin.testing.netns_nodes import SERVING_PORT, NetnsNodes
from tests.integration.netns.conftest import fake_model_dir, netns_cluster

HOSTS = ("prefill", "decode", "other")
PROMPT = [9] * 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("netns-allowlist")
    model = ["--engine", "fake", "--no-warmup", "--model", fake_model_dir(workdir / "fake")]
    with netns_cluster(workdir, HOSTS) as nodes:
        allowed = f"{nodes.net.address('decode')}:{SERVING_PORT}"
        started = {
            "decode": nodes.start("decode", "decode", "decode-allowed", model),
            "other": nodes.start("other", "decode", "decode-refused", model),
            "prefill": nodes.start("prefill", "prefill", "prefill", model,
                                   env={"MLXCEL_DECODE_ALLOWLIST": allowed}),
        }
        nodes.wait_all(60)
        yield {"nodes": nodes, **started}


def generate(nodes: NetnsNodes, prefill, decode, request_id: str):
    async def go():
        async with LinkDriver(nodes.secret, prefill.serving_bind, decode.serving_bind) as driver:
            return await driver.generate(request_id, PROMPT, 5)

    return asyncio.run(go())


def test_an_allowed_decode_target_gets_the_kv(cluster):
    outcome = generate(cluster["nodes"], cluster["prefill"], cluster["decode"], "allowed")
    assert outcome.ok, outcome
    assert outcome.tokens == expected_tokens(GenerationRequest("allowed", tuple(PROMPT), 5))


def test_a_target_off_the_allowlist_is_refused_before_any_kv_moves(cluster):
    outcome = generate(cluster["nodes"], cluster["prefill"], cluster["other"], "refused")
    assert outcome.error_code == "decode_target_refused", outcome
    assert outcome.tokens == []


def listening_addresses(nodes: NetnsNodes, host: str) -> set[str]:
    """Local addresses of every TCP listener in ``host``'s namespace."""
    out = subprocess.run(nodes.net.exec_argv(host, ["ss", "-ltnH"]), capture_output=True,
                         text=True, check=True, timeout=10).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize("host", HOSTS)
def test_nodes_listen_only_on_their_hosts_address(cluster, host):
    nodes = cluster["nodes"]
    found = listening_addresses(nodes, host)
    assert found == {nodes.net.address(host)}
    assert not ipaddress.ip_address(nodes.net.address(host)).is_loopback
    # ops endpoint, link listener and bulk listener: all reachable from another host
    assert cluster[host].is_healthy()
