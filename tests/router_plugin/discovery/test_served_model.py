"""Discovery entries carry their model NAME; each pool of a several-model router takes
only its own (peers file, mdns TXT, Kubernetes label), a one-model router takes all."""

from __future__ import annotations

from pathlib import Path

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.discovery_api import DiscoveryConfig
from mlxcel_plugin.nodes.mdns_advert import service_info
from router_plugin.discovery.kubernetes import SYNC, apply_event, pod_member
from router_plugin.discovery.peers_file import parse_peers_file
from router_plugin.discovery.served_model import belongs, pool_model
from tests.router_plugin.discovery.test_sources import pod

PEERS = """
prefill = [{ address = "10.0.0.1:9000", model = "alpha" }, "10.0.0.2:9000"]
decode = [{ address = "10.0.0.3:9000", model = "beta" }]
"""


def test_a_peers_file_entry_naming_a_model_joins_only_its_pool() -> None:
    def addresses(model: str | None) -> set[str]:
        return {m.address for m in parse_peers_file(PEERS, model=model)}

    assert addresses("alpha") == {"10.0.0.1:9000", "10.0.0.2:9000"}
    assert addresses("beta") == {"10.0.0.2:9000", "10.0.0.3:9000"}
    assert len(addresses(None)) == 3


def test_only_a_several_model_router_filters_by_name(tmp_path: Path) -> None:
    one = ServerConfig(role="router", model=str(tmp_path), served_model_name="alias")
    several = ServerConfig(role="router", model=str(tmp_path), served_model_name="alpha",
                           sections={"models": {"beta": {}}})  # fmt: skip
    assert pool_model(one) is None  # its nodes may announce another alias of its model
    assert pool_model(several) == "alpha"
    assert belongs(None, "alpha") and belongs("", "alpha") and belongs("x", None)
    assert not belongs("beta", "alpha")


def test_a_pod_labelled_with_another_model_is_not_in_the_pool() -> None:
    config = DiscoveryConfig()
    labelled = pod("d0")
    labelled.metadata.labels["mlxcel.io/model"] = "beta"
    assert pod_member(labelled, config, model="beta") is not None
    assert pod_member(labelled, config, model="alpha") is None
    assert pod_member(pod("d1"), config, model="alpha") is not None  # no label: every pool
    members: dict = {}
    assert apply_event(members, {"type": SYNC, "object": [labelled, pod("d1")]}, config,
                       "alpha")  # fmt: skip
    assert set(members) == {"d1"}


def test_a_node_announces_its_served_model_over_mdns(tmp_path: Path) -> None:
    config = ServerConfig(role="decode", model=str(tmp_path / "ckpt"),
                          serving_bind="127.0.0.1:9000")  # fmt: skip
    named = ServerConfig(role="decode", model=str(tmp_path), served_model_name="alpha",
                         serving_bind="127.0.0.1:9000")  # fmt: skip
    assert service_info(config, "n").properties[b"model"] == b"ckpt"
    assert service_info(named, "n").properties[b"model"] == b"alpha"
