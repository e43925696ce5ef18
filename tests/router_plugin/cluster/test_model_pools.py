"""``[models.NAME]`` sections -> one router config per served model (no sockets)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.errors import ConfigError
from router_plugin.cluster.model_pools import has_model_pools, model_pool_configs


def _router(tmp_path: Path, models: dict, **fields) -> ServerConfig:
    return ServerConfig(role="router", model=str(tmp_path), sections={"models": models}, **fields)


def test_each_section_is_a_pool_named_by_its_key(tmp_path: Path) -> None:
    models = {"b": {"model": str(tmp_path), "prefill_peers": ["127.0.0.1:1"],
                    "decode_peers": "127.0.0.1:2, 127.0.0.1:3"}}  # fmt: skip
    config = _router(tmp_path, models, served_model_name="a",
                     prefill_peers=("127.0.0.1:4",), decode_peers=("127.0.0.1:5",))
    pools = model_pool_configs(config)
    assert has_model_pools(config) and list(pools) == ["a", "b"]  # the router's own first
    assert pools["b"].served_model_name == "b"
    assert pools["b"].decode_peers == ("127.0.0.1:2", "127.0.0.1:3")
    assert pools["a"] is config


def test_a_router_without_peers_of_its_own_serves_the_sections_only(tmp_path: Path) -> None:
    config = _router(tmp_path, {"b": {"model": str(tmp_path), "peers_file": "p.toml"}})
    assert list(model_pool_configs(config)) == ["b"]


@pytest.mark.parametrize(("entry", "message"), [
    ({"model": "/nowhere", "peers": ["127.0.0.1:1"]}, "checkpoint directory"),
    ({"model": "HERE"}, "needs prefill_peers"),
    ({"model": "HERE", "peers": ["127.0.0.1:1"], "weights": 1}, "unknown key"),
    ({"model": "HERE", "peers": ["nohost"]}, "host:port"),
    ("text", "must be a table"),
])  # fmt: skip
def test_a_bad_section_is_refused_by_name(tmp_path: Path, entry, message: str) -> None:
    if isinstance(entry, dict) and entry.get("model") == "HERE":
        entry = {**entry, "model": str(tmp_path)}
    with pytest.raises(ConfigError, match=message):
        model_pool_configs(_router(tmp_path, {"b": entry}))


def test_a_model_served_twice_is_refused(tmp_path: Path) -> None:
    config = replace(_router(tmp_path, {"a": {"model": str(tmp_path), "peers": ["h:1"]}}),
                     served_model_name="a", peers=("h:2",))
    with pytest.raises(ConfigError, match="served twice"):
        model_pool_configs(config)
