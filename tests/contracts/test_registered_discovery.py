"""Every registered discovery source passes the shared discovery contract."""

from __future__ import annotations

import threading

import pytest

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.discovery_api import DiscoveryConfig
from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.testing.discovery_contract import DiscoveryContract
from tests.router_plugin.discovery.local_dns import LocalDns

REGISTRY = load_plugins()
NODE = "127.0.0.1:7101"


def blocking_stream(events):
    def stream(stop: threading.Event):
        yield from events
        stop.wait()  # a real watch blocks until the next event

    return stream


def case_for(name: str, tmp_path, dns: LocalDns):
    """A hermetic source for each built-in; a third-party one gets defaults and any snapshot."""
    factory = REGISTRY.get("discovery", name)
    discovery = DiscoveryConfig(interval_s=0.1, nameservers=(dns.nameserver,))
    if name == "static":
        return factory(ServerConfig(decode_peers=(NODE,)), discovery), {("decode", NODE)}
    if name == "file":
        path = tmp_path / "peers.toml"
        path.write_text(f'decode = ["{NODE}"]\n')
        return factory(ServerConfig(peers_file=str(path)), discovery), {("decode", NODE)}
    if name == "dns":
        dns.set("decode.test", "127.0.0.1")
        config = ServerConfig(decode_peers=("dns:decode.test:7101",))
        return factory(config, discovery), {("decode", NODE)}
    if name == "kubernetes":
        from router_plugin.discovery.kubernetes import SYNC, KubernetesSource

        return KubernetesSource(ServerConfig(), discovery,
                                stream=blocking_stream([{"type": SYNC, "object": []}])), set()
    if name == "mdns":
        pytest.importorskip("zeroconf")
    return factory(ServerConfig(), discovery), None


class TestRegisteredDiscovery(DiscoveryContract):
    @pytest.fixture(params=REGISTRY.names("discovery"))
    def case(self, request, tmp_path):
        with LocalDns() as dns:
            source, expected = case_for(request.param, tmp_path, dns)
            yield request.param, source, expected


def test_every_built_in_source_is_registered():
    assert {"static", "file", "dns", "mdns", "kubernetes"} <= set(REGISTRY.names("discovery"))
