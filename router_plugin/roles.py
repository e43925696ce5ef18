"""The ``hybrid`` role: one node, the HTTP front over a local engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from mlxcel_plugin.engine_api import Engine
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.plugins import PluginRegistry
from mlxcel_plugin.text import TextTokenizer
from router_plugin.backend import LocalEngineBackend
from router_plugin.front import make_app

logger = logging.getLogger(__name__)


def _model_dir(config: Any) -> str:
    if not config.model:
        raise ConfigError("the hybrid role needs a resolved --model checkpoint directory")
    return str(config.model)


def served_model_name(config: Any) -> str:
    return config.served_model_name or Path(_model_dir(config)).name


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
    return make_app(
        LocalEngineBackend(engine),
        tokenizer,
        served_model_name(config),
        lifespan=_engine_lifespan(engine),
    )


def run_hybrid(config: Any, registry: PluginRegistry) -> None:
    """Serve until interrupted (``mlxcel_register_roles`` entry for ``hybrid``)."""
    app = make_hybrid_app(config, registry)
    logger.info("hybrid node serving %s on http://%s:%s", served_model_name(config),
                config.host, config.port)  # fmt: skip
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        workers=1,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
