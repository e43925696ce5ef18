"""Model pools: one router over several models, each served by its own prefill/decode nodes.

A ``[models.NAME]`` TOML section names a pool: the checkpoint directory the router
reads the tokenizer and chat template from (``model``; no weights are loaded) and
where its nodes are (``prefill_peers``, ``decode_peers``, ``peers``, ``peers_file``,
``discovery``). A request is routed by its ``model`` field to that pool, which has
its own balancers, prefix index, admission and metrics (``model_name`` label). The
link verdict still checks each node's model digest against the pool's checkpoint,
so a node of another model in a pool's list never gets its traffic.

The router's own ``--model`` with ``--prefill-peers``/``--decode-peers`` (or
``--peers``, ``--peers-file``, ``--discovery``) is one more pool, named by
``--served-model-name`` (or the checkpoint directory's name), and the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from mlxcel_plugin.config import ServerConfig, split_addresses
from mlxcel_plugin.errors import ConfigError

MODELS_SECTION = "models"


@dataclass(frozen=True)
class ModelPoolEntry:
    """The keys of one ``[models.NAME]`` table (the reference lists them from here)."""

    model: str  # checkpoint directory: the pool's tokenizer and chat template (no weights)
    prefill_peers: tuple[str, ...] = ()  # the pool's prefill nodes, as --prefill-peers
    decode_peers: tuple[str, ...] = ()  # the pool's decode nodes, as --decode-peers
    peers: tuple[str, ...] = ()  # nodes whose role the router asks, as --peers
    peers_file: str = ""  # the pool's peers file, as --peers-file
    discovery: str = ""  # the pool's discovery sources, as --discovery


_PEER_LISTS = ("prefill_peers", "decode_peers", "peers")
POOL_KEYS = frozenset(f.name for f in fields(ModelPoolEntry))


def has_model_pools(config: ServerConfig) -> bool:
    return bool(config.section(MODELS_SECTION))


def _own_pool(config: ServerConfig) -> bool:
    return bool(config.peers or (config.prefill_peers and config.decode_peers)
                or config.peers_file or config.discovery)  # fmt: skip


def own_pool_name(config: ServerConfig) -> str:
    if not config.model:
        raise ConfigError("the router needs --model (the checkpoint its tokenizer comes from)")
    return config.served_model_name or Path(config.model).name


def _pool_config(config: ServerConfig, name: str, entry: Any) -> ServerConfig:
    where = f"[{MODELS_SECTION}.{name}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(entry) - POOL_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(POOL_KEYS))}")  # fmt: skip
    model = entry.get("model")
    if not isinstance(model, str) or not Path(model).is_dir():
        raise ConfigError(f"{where}: model must be a checkpoint directory, got {model!r}")
    lists = {key: split_addresses(entry.get(key, ())) for key in _PEER_LISTS}
    pool = replace(config, model=model, served_model_name=name,
                   peers_file=entry.get("peers_file") or None,
                   discovery=entry.get("discovery", ""), **lists)  # fmt: skip
    if not _own_pool(pool):
        raise ConfigError(f"{where} needs prefill_peers and decode_peers, peers, peers_file "
                          "or discovery")  # fmt: skip
    return pool


def model_pool_configs(config: ServerConfig) -> dict[str, ServerConfig]:
    """One router config per served model, the default (first) one first."""
    pools: dict[str, ServerConfig] = {}
    if _own_pool(config):
        pools[own_pool_name(config)] = config
    for name, entry in config.section(MODELS_SECTION).items():
        if name in pools:
            raise ConfigError(f"[{MODELS_SECTION}.{name}]: the model {name!r} is served twice")
        pools[name] = _pool_config(config, name, entry)
    if not pools:
        raise ConfigError("the router serves no model: give peers or [models.NAME] sections")
    return pools
