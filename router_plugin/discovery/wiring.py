"""Starts the discovery sources a router's config asks for, with the router's app.

``static`` always runs; ``file`` with ``--peers-file``; ``dns`` when a peer flag
has a ``dns:`` entry; ``--discovery`` adds any registered source (``mdns``,
``kubernetes``, a plugin's). Membership shows in ``/router/stats`` and
``/metrics`` (``mlxcel:router_membership_changes``, ``mlxcel:router_pool_nodes``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.discovery_api import (
    NODE_ROLES,
    DiscoveryConfig,
    DiscoverySource,
    is_dns_entry,
    model_fingerprint,
)
from mlxcel_plugin.link import require_cluster_secret
from mlxcel_plugin.nodes.decode_allowlist import DecodeAllowlist
from mlxcel_plugin.plugins import PluginRegistry
from router_plugin.cluster.backend import ClusterBackend
from router_plugin.cluster.node_pool import NodeHealth
from router_plugin.cluster.peer_links import PeerLink, make_dialer
from router_plugin.discovery.membership import DRAINING, Membership

logger = logging.getLogger(__name__)

DISCOVERY_SECTION = "discovery"


def source_names(config: ServerConfig) -> list[str]:
    """The sources to run, in order, each once."""
    names = ["static"]
    if config.peers_file:
        names.append("file")
    if any(is_dns_entry(entry) for entry in (*config.prefill_peers, *config.decode_peers)):
        names.append("dns")
    names += [name.strip() for name in config.discovery.split(",") if name.strip()]
    return list(dict.fromkeys(names))


def make_sources(config: ServerConfig, registry: PluginRegistry) -> list[DiscoverySource]:
    discovery = DiscoveryConfig.from_section(config.section(DISCOVERY_SECTION))
    return [registry.get("discovery", name)(config, discovery) for name in source_names(config)]


def make_membership(config: ServerConfig, backend: ClusterBackend,
                    env: Mapping[str, str]) -> Membership:
    secret = require_cluster_secret("router", config.cluster_secret_file, env)
    dial = make_dialer(secret, config.effective_node_id,
                       expected_model=model_fingerprint(config.model))
    pool = backend.pool

    def make_peer(node_id: str) -> PeerLink:
        return PeerLink(node_id, pool.role(node_id), pool.address(node_id), dial, pool,
                        on_change=backend.on_load_change)

    discovery = DiscoveryConfig.from_section(config.section(DISCOVERY_SECTION))
    return Membership(backend.peers, make_peer, fingerprint=model_fingerprint(config.model),
                      allowlist=DecodeAllowlist.from_env(env),
                      drain_timeout_s=discovery.drain_timeout_s)


def attach_discovery(app: FastAPI, config: ServerConfig, registry: PluginRegistry,
                     backend: ClusterBackend, env: Mapping[str, str]) -> Membership:
    """Run the sources for as long as ``app`` serves (after its peers start)."""
    sources = make_sources(config, registry)  # unknown names fail here, at startup
    membership = make_membership(config, backend, env)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[Any]:
        async with inner(app_) as state:
            membership.start(sources)
            try:
                yield state
            finally:
                await membership.close()

    app.router.lifespan_context = lifespan
    app.state.front.metrics.registry.register(MembershipCollector(membership))
    logger.info("discovery sources: %s", ", ".join(source.name for source in sources))
    return membership


class MembershipCollector:
    """Membership changes and pool sizes, read at scrape time."""

    def __init__(self, membership: Membership):
        self.membership = membership

    def collect(self) -> Any:
        changes = CounterMetricFamily("mlxcel:router_membership_changes",
                                      "Nodes joined, draining, left or refused, by role.",
                                      labels=["role", "change"])
        for (role, change), count in sorted(self.membership.counts.items()):
            changes.add_metric([role, change], count)
        nodes = GaugeMetricFamily("mlxcel:router_pool_nodes", "Nodes in the pool, by state.",
                                  labels=["role", "state"])
        pool = self.membership.pool
        for role in NODE_ROLES:
            ids = pool.ids(role)
            draining = sum(pool.health(i) is NodeHealth.DRAINING for i in ids)
            nodes.add_metric([role, "serving"], len(ids) - draining)
            nodes.add_metric([role, DRAINING], draining)
        yield changes
        yield nodes
