"""Several models on one hybrid node: ``--model NAME=PATH`` repeated.

Each model gets a whole front of its own (tokenizer, chat template, metrics),
like a several-model router's pools (``model_dispatch``); requests go to it by
``model``. Its backend leases the model's engine from one ``ModelSet``, which
loads it on first use and evicts the least recently used idle model when a
bound would break. ``/v1/models`` lists every configured model with
``loaded``; ``/metrics`` carries each model's loads and evictions
(docs/models-and-adapters.md).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from mlxcel_plugin.engine_api import Engine, EngineStats, GenerationRequest, TokenEvent
from mlxcel_plugin.kv_serde.pool import machine_memory_bytes
from mlxcel_plugin.model_specs import checkpoint_bytes, from_flags
from mlxcel_plugin.plugins import PluginRegistry
from mlxcel_plugin.prefix_cache_metrics import register_prefix_cache
from mlxcel_plugin.scheduling.model_residency import MIB, ResidencyLimits
from mlxcel_plugin.scheduling.model_set import LoadEngine, ModelSet
from mlxcel_plugin.scheduling.model_set_metrics import register_model_set
from mlxcel_plugin.speculative.metrics import register_speculative
from mlxcel_plugin.text import TextTokenizer
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app
from router_plugin.http.model_dispatch import ModelDispatcher, model_cards
from router_plugin.http.options import FrontOptions

logger = logging.getLogger(__name__)


class ModelSetBackend:
    """One model's token stream: its engine leased (loaded when needed) for the request."""

    def __init__(self, models: ModelSet, name: str):
        self.models, self.name = models, name

    def is_ready(self) -> bool:
        return True  # an unloaded model loads on the request that needs it

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        async with self.models.lease(self.name) as engine:
            async for batch in LocalEngineBackend(engine).stream(request):
                yield batch


class NodeModelsDispatcher(ModelDispatcher):
    """The dispatcher of a several-model hybrid: ``/v1/models`` says which models are loaded."""

    def __init__(self, apps: Mapping[str, FastAPI], models: ModelSet, *,
                 max_request_bytes: int):  # fmt: skip
        super().__init__(apps, max_request_bytes=max_request_bytes)
        self.models = models

    def _merge_models(self, bodies: list[bytes]) -> Response:
        status = self.models.status()
        cards = model_cards(bodies)
        for card in cards:
            card["loaded"] = status.get(card["id"], False)
        return JSONResponse({"object": "list", "data": cards})


def make_loader(config: Any, registry: PluginRegistry) -> LoadEngine:
    """The engine plugin's factory, started: what a ``ModelSet`` load runs in its thread."""
    factory = registry.get("engine", config.engine)

    def load(name: str, path: str) -> Engine:
        engine = factory(path, config.engine_config)
        engine.start()
        return engine

    return load


def make_model_set(config: Any, load: LoadEngine) -> ModelSet:
    paths = {spec.name: spec.path for spec in from_flags(config.models)}
    memory = config.model_memory_bytes or machine_memory_bytes() // 2
    limits = ResidencyLimits(max_loaded=config.max_loaded_models, memory_bytes=memory)
    sizes = {name: checkpoint_bytes(path) for name, path in paths.items()}
    return ModelSet(paths, sizes, limits, load, wait_s=config.model_wait_s)


def _model_set_lifespan(models: ModelSet, load_on_start: bool) -> Any:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await models.start(load_on_start)
        try:
            yield
        finally:
            await models.close()

    return lifespan


def _register_metrics(app: FastAPI, models: ModelSet, name: str) -> None:
    """The model's loads and evictions, and its engine's series while loaded (a reload starts
    the engine's counters again, which Prometheus reads as a counter reset)."""
    def stats() -> EngineStats:
        engine = models.engine(name)
        return engine.stats() if engine is not None else EngineStats()

    registry = app.state.front.metrics.registry
    register_model_set(registry, models, [name])
    register_prefix_cache(registry, lambda: stats().prefix_cache)
    register_speculative(registry, lambda: stats().speculative)


def make_models_hybrid_app(config: Any, registry: PluginRegistry) -> NodeModelsDispatcher:
    """One front per configured model over one ``ModelSet``; the first model is the default."""
    models = make_model_set(config, make_loader(config, registry))
    options = FrontOptions.from_config(config)
    apps = {}
    for name, path in models.paths.items():
        lifespan = None if apps else _model_set_lifespan(models, config.load_on_start)
        app = make_app(ModelSetBackend(models, name), TextTokenizer.from_dir(path), name,
                       lifespan=lifespan, options=options)  # fmt: skip
        _register_metrics(app, models, name)
        apps[name] = app
    limits = models.limits
    logger.info("models: %s; at most %s loaded, %.0f MiB of weights; %s",
                ", ".join(f"{n} ({s / MIB:.0f} MiB)" for n, s in models.sizes.items()),
                limits.max_loaded or "any number", limits.memory_bytes / MIB,
                "loaded at start" if config.load_on_start else "each loaded on first use")
    return NodeModelsDispatcher(apps, models, max_request_bytes=options.max_request_bytes)
