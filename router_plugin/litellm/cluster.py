"""Which cluster a LiteLLM call is for, and opening it: settings, links, health, the text front.

Cluster settings come from the model's ``litellm_params`` (``prefill_peers``,
``decode_peers``, ``model_dir``, ``cluster_secret_file``, ...), else from the
environment (``MLXCEL_PREFILL_PEERS``, ``MLXCEL_DECODE_PEERS``,
``MLXCEL_MODEL``, ``MLXCEL_CLUSTER_SECRET_FILE``), merged by ``build_config``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.config import ServerConfig, build_config
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.text import TextTokenizer
from router_plugin.cluster.backend import ClusterBackend
from router_plugin.http.front import OpenAIFront
from router_plugin.http.metrics import FrontMetrics
from router_plugin.roles import make_cluster_backend, served_model_name

# The provider's logger name, as before this module was split from it.
logger = logging.getLogger("router_plugin.litellm.provider")

# litellm_params key -> ServerConfig field (what the router's CLI flags set).
CLUSTER_PARAMS = {
    "prefill_peers": "prefill_peers",
    "decode_peers": "decode_peers",
    "model_dir": "model",
    "served_model_name": "served_model_name",
    "cluster_secret_file": "cluster_secret_file",
    "distributed_config": "distributed_config",
    "prefill_balancer": "prefill_balancer",
    "decode_balancer": "decode_balancer",
    "node_id": "node_id",
}
READY_TIMEOUT_PARAM = "ready_timeout_s"
PROVIDER_PARAMS = frozenset(CLUSTER_PARAMS) | {READY_TIMEOUT_PARAM}
# The first request waits this long for links to both pools before it may be refused.
DEFAULT_READY_TIMEOUT_S = 10.0
READY_POLL_S = 0.05


@dataclass(frozen=True)
class ClusterSettings:
    """What identifies a cluster: the flag values given in ``litellm_params`` (hashable)."""

    flags: tuple[tuple[str, Any], ...]
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S

    @classmethod
    def from_params(cls, *sources: Mapping[str, Any] | None) -> ClusterSettings:
        """Later sources win; ``None`` values count as unset (env/defaults apply)."""
        merged: dict[str, Any] = {}
        for source in sources:
            merged.update({k: v for k, v in (source or {}).items()
                           if k in PROVIDER_PARAMS and v is not None})  # fmt: skip
        timeout_s = float(merged.pop(READY_TIMEOUT_PARAM, DEFAULT_READY_TIMEOUT_S))
        # Lists from YAML become tuples so the settings can key the cluster table.
        flags = {CLUSTER_PARAMS[k]: tuple(v) if isinstance(v, list) else v
                 for k, v in merged.items()}  # fmt: skip
        return cls(tuple(sorted(flags.items())), timeout_s)

    def server_config(self, env: Mapping[str, str]) -> ServerConfig:
        """The router's config: these values over env vars over defaults."""
        config = build_config({**dict(self.flags), "role": "router"}, env)
        if not config.model:
            # Imported here: the CLI module is only needed for the embedded default model.
            from mlxcel_plugin.cli import resolve_model

            config = resolve_model(config)
        return config


def check_peers(flags: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """A provider-worded error instead of the CLI's flag names."""
    for key, var in (("prefill_peers", "MLXCEL_PREFILL_PEERS"),
                     ("decode_peers", "MLXCEL_DECODE_PEERS")):  # fmt: skip
        if not flags.get(key) and not env.get(var):
            raise ConfigError(f"the mlxcel provider needs {key} in litellm_params or {var}")


@dataclass
class Cluster:
    """The router's state for one event loop: backend (links, health) and the text front."""

    backend: ClusterBackend
    front: OpenAIFront

    async def close(self) -> None:
        await self.backend.health.close()
        await self.backend.peers.close()


def _load(
    settings: ClusterSettings, env: Mapping[str, str]
) -> tuple[ServerConfig, Any, TextTokenizer]:
    # Blocking (files, tokenizer, entry points): runs in a worker thread.
    check_peers(dict(settings.flags), env)
    config = settings.server_config(env)
    return config, load_plugins(env), TextTokenizer.from_dir(str(config.model))


async def wait_until_ready(backend: ClusterBackend, timeout_s: float) -> bool:
    """Until both pools have a healthy node, or ``timeout_s``; False on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not backend.is_ready():  # bounded by the deadline
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(READY_POLL_S)
    return True


async def open_cluster(settings: ClusterSettings, env: Mapping[str, str]) -> Cluster:
    config, registry, tokenizer = await asyncio.to_thread(_load, settings, env)
    backend = make_cluster_backend(config, registry, env)
    name = served_model_name(config)
    front = OpenAIFront(backend, tokenizer, name, context_length=None,
                        system_fingerprint=None, metrics=FrontMetrics(name))  # fmt: skip
    backend.peers.start()
    backend.health.start()
    if not await wait_until_ready(backend, settings.ready_timeout_s):
        # Not fatal: a node may come up later; until then requests get 503s.
        logger.warning("mlxcel cluster not ready after %.1fs", settings.ready_timeout_s)
    return Cluster(backend, front)
