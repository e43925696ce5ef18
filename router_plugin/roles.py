"""The HTTP roles: ``hybrid`` (the front over a local engine) and ``router`` (over the cluster)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from mlxcel_plugin.adapter_specs import check_bases, parse_adapter_spec
from mlxcel_plugin.balancer_api import Balancer
from mlxcel_plugin.compatibility import NodeProfile
from mlxcel_plugin.config import dataclass_from_mapping
from mlxcel_plugin.discovery_api import model_fingerprint
from mlxcel_plugin.engine_api import Engine
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.gc_pauses import freeze_startup_heap
from mlxcel_plugin.link import require_cluster_secret
from mlxcel_plugin.nodes.roles import node_settings
from mlxcel_plugin.plugins import PluginRegistry
from mlxcel_plugin.prefix_cache_metrics import register_prefix_cache
from mlxcel_plugin.speculative.metrics import register_speculative
from mlxcel_plugin.text import TextTokenizer
from router_plugin.cluster.adapter_commands import ClusterAdapters
from router_plugin.cluster.adapter_routing import ServedAdapters
from router_plugin.cluster.admission import AdmissionController, BackpressureConfig
from router_plugin.cluster.backend import ClusterBackend, RouterConfig
from router_plugin.cluster.health import HealthConfig, HealthMonitor
from router_plugin.cluster.model_pools import has_model_pools, model_pool_configs
from router_plugin.cluster.node_pool import NodePool
from router_plugin.cluster.pairing import PairingTable
from router_plugin.cluster.peer_links import PeerLinks, make_dialer
from router_plugin.cluster.prefix_index import PrefixIndex
from router_plugin.cluster.stats import RouterCollector, RouterStats, make_stats_route
from router_plugin.cluster.stream_bridge import DECODE, PREFILL
from router_plugin.discovery import discover_pools
from router_plugin.discovery.membership import with_membership
from router_plugin.discovery.wiring import attach_discovery
from router_plugin.http.adapters_api import install_adapter_routes
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.drain import DrainGate, DrainingServer
from router_plugin.http.front import make_app
from router_plugin.http.model_dispatch import ModelDispatcher
from router_plugin.http.node_models import make_models_hybrid_app
from router_plugin.http.options import FrontOptions

logger = logging.getLogger(__name__)

# The drain already waited for in-flight requests: what is left after it is cancelled soon.
CANCEL_AFTER_DRAIN_S = 1


def _model_dir(config: Any) -> str:
    if not config.model:
        raise ConfigError(f"the {config.role} role needs a resolved --model checkpoint directory")
    return str(config.model)


def served_model_name(config: Any) -> str:
    return config.served_model_name or Path(_model_dir(config)).name


def adapter_names(config: Any) -> dict[str, str]:
    """``--adapter`` names -> their base: each is a model a request may name."""
    specs = [parse_adapter_spec(text) for text in config.engine_config.adapters]
    check_bases(specs, served_model_name(config))
    return {spec.name: served_model_name(config) for spec in specs}


def _engine_lifespan(engine: Engine) -> Any:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # start() may warm up for seconds: keep the loop free (signals, logs) meanwhile.
        await asyncio.to_thread(engine.start)
        try:
            yield
        finally:
            engine.close()

    return lifespan


def make_hybrid_app(config: Any, registry: PluginRegistry) -> FastAPI:
    """The hybrid app; the engine starts and closes with the app's lifespan."""
    model_dir = _model_dir(config)
    tokenizer = TextTokenizer.from_dir(model_dir)
    engine = registry.get("engine", config.engine)(model_dir, config.engine_config)
    # The context comes from the checkpoint's config (like the router's), so both modes agree.
    app = make_app(
        LocalEngineBackend(engine),
        tokenizer,
        served_model_name(config),
        lifespan=_engine_lifespan(engine),
        options=FrontOptions.from_config(config),
    )
    app.state.front.adapters = adapter_names(config)
    install_adapter_routes(app, engine, served_model_name(config))
    register_prefix_cache(app.state.front.metrics.registry, lambda: engine.stats().prefix_cache)
    register_speculative(app.state.front.metrics.registry, lambda: engine.stats().speculative)
    return app


def run_hybrid(config: Any, registry: PluginRegistry) -> None:
    """Serve until interrupted (``mlxcel_register_roles`` entry for ``hybrid``)."""
    if config.models:  # several --model NAME=PATH (router_plugin/http/node_models.py)
        dispatcher = make_models_hybrid_app(config, registry)
        logger.info("hybrid node serving %s on http://%s:%s", ", ".join(dispatcher.apps),
                    config.host, config.port)  # fmt: skip
        _serve(dispatcher, config, dispatcher)
        return
    app = make_hybrid_app(config, registry)
    logger.info("hybrid node serving %s on %s://%s:%s", served_model_name(config),
                "https" if config.ssl_certfile else "http", config.host, config.port)  # fmt: skip
    _serve(app, config)


# -- router ---------------------------------------------------------------------


def _balancers(config: Any, registry: PluginRegistry, seed: int) -> dict[str, Balancer]:
    # One RNG per pool, seeded apart: the two pools should not break ties in lockstep.
    return {
        PREFILL: registry.get("balancer", config.prefill_balancer)(random.Random(seed)),
        DECODE: registry.get("balancer", config.decode_balancer)(random.Random(seed + 1)),
    }


def make_cluster_backend(config: Any, registry: PluginRegistry,
                         env: Mapping[str, str]) -> ClusterBackend:
    """Peers, health monitor, balancers and admission from the config (nothing started)."""
    secret = require_cluster_secret("router", config.cluster_secret_file, env)
    router_config = RouterConfig.from_section(config.section("router"))
    backpressure = dataclass_from_mapping(
        BackpressureConfig, config.section("backpressure"), "[backpressure]"
    )
    # Nodes whose tokenizer or chat template differ from the router's are refused.
    pool = NodePool.from_peers(config.prefill_peers, config.decode_peers,
                               prefixes=PrefixIndex(router_config.prefix_block_tokens),
                               pairing=PairingTable(NodeProfile.of_text(config.model)))
    dial = make_dialer(secret, config.effective_node_id,
                       expected_model=model_fingerprint(config.model))
    peers = PeerLinks(pool, dial)
    health = HealthMonitor(peers, HealthConfig.from_section(config.section("health")))
    local_prefill_tokens = config.engine_config.prefix_cache.local_prefill_tokens
    return ClusterBackend(
        peers, health, _balancers(config, registry, router_config.seed),
        AdmissionController(backpressure), RouterStats(), config=router_config,
        local_prefill_tokens=local_prefill_tokens,
    )  # fmt: skip


def _cluster_lifespan(backend: ClusterBackend) -> Any:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        backend.peers.start()
        backend.health.start()
        try:
            yield
        finally:
            await backend.health.close()
            await backend.peers.close()

    return lifespan


def make_router_app(config: Any, registry: PluginRegistry,
                    env: Mapping[str, str] | None = None) -> FastAPI:
    """The router app: tokenizer and chat template only, tokens from the cluster."""
    env = os.environ if env is None else env
    backend = make_cluster_backend(config, registry, env)
    tokenizer = TextTokenizer.from_dir(_model_dir(config))
    app = make_app(backend, tokenizer, served_model_name(config),
                   lifespan=_cluster_lifespan(backend), options=FrontOptions.from_config(config))
    queue_depth = backend.admission.__len__
    names = {role: balancer.name for role, balancer in backend.balancers.items()}
    route = make_stats_route(backend.stats, backend.pool, queue_depth, names, env=env)
    membership = attach_discovery(app, config, registry, backend, env)  # nodes join at runtime
    app.add_api_route("/router/stats", with_membership(route, membership), methods=["GET"])
    app.state.front.metrics.registry.register(
        RouterCollector(backend.stats, backend.pool, queue_depth)
    )
    app.state.backend = backend
    # Adapters the nodes announce are models a request may name; load/unload reach every node.
    app.state.front.adapters = ServedAdapters(backend.pool, served_model_name(config),
                                              backend.clock)  # fmt: skip
    install_adapter_routes(app, None, served_model_name(config), ClusterAdapters(backend.peers))
    return app


def make_models_router_app(pools: Mapping[str, Any], registry: PluginRegistry,
                           env: Mapping[str, str] | None = None) -> ModelDispatcher:
    """A router over several models (``model_pools``): one router app per model, by ``model``."""
    apps = {name: make_router_app(pool, registry, env) for name, pool in pools.items()}
    first = next(iter(pools.values()))
    return ModelDispatcher(apps, max_request_bytes=first.max_request_bytes)


def run_router(config: Any, registry: PluginRegistry) -> None:
    """Serve until interrupted (``mlxcel_register_roles`` entry for ``router``)."""
    secret = require_cluster_secret("router", config.cluster_secret_file, os.environ)
    if has_model_pools(config):
        pools = {name: discover_pools(pool, secret)
                 for name, pool in model_pool_configs(config).items()}  # fmt: skip
        dispatcher = make_models_router_app(pools, registry)
        logger.info("router serving %s on http://%s:%s", ", ".join(pools), config.host,
                    config.port)  # fmt: skip
        _serve(dispatcher, config, dispatcher)
        return
    config = discover_pools(config, secret)
    app = make_router_app(config, registry)
    logger.info("router serving %s on http://%s:%s (%d prefill, %d decode peers)",
                served_model_name(config), config.host, config.port,
                len(config.prefill_peers), len(config.decode_peers))  # fmt: skip
    _serve(app, config)


def _serve(app: Any, config: Any, front: Any = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain (``drain.py``) and return (exit status 0)."""
    freeze_startup_heap()  # imports and the app: full GC passes stay short
    gate = DrainGate(app, front or app.state.front)
    server_config = uvicorn.Config(
        gate,
        host=config.host,
        port=config.port,
        workers=1,
        log_level="warning",
        access_log=False,  # /metrics counts requests; a log line per request is pure cost
        timeout_graceful_shutdown=CANCEL_AFTER_DRAIN_S,
        ssl_keyfile=config.ssl_keyfile,  # HTTPS when both are given
        ssl_certfile=config.ssl_certfile,
    )
    DrainingServer(server_config, gate, node_settings(config).drain_timeout_s).run()
