"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's shape).

Body: ``{"lora_name": NAME, "lora_path": PATH}`` (unload: ``lora_name`` only);
behind the API key like every ``/v1/*`` route. On a hybrid node the engine
loads the adapter between decode steps (``engines/lora/engine.py``); on a
router every prefill and decode node of the pool does
(``router_plugin/cluster/adapter_commands.py``). Once it answers, requests may
name ``NAME`` as their ``model``. After an unload a request naming it gets 404
``model_not_found``, while requests already running finish on it.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.routing import Route

from mlxcel_plugin.errors import InvalidRequestError, MlxcelError

MAX_BODY_BYTES = 64 * 1024


class AdapterManager(Protocol):
    """Loads and unloads adapters where requests run (one engine, or every node)."""

    async def load(self, name: str, path: str) -> dict[str, Any]: ...  # {"digest": ...}

    async def unload(self, name: str) -> dict[str, Any]: ...


async def _fields(request: Request, names: tuple[str, ...]) -> list[str]:
    raw = await request.body()
    try:
        body = json.loads(raw[:MAX_BODY_BYTES]) if len(raw) <= MAX_BODY_BYTES else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    values = [body.get(name) for name in names]
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{name} must be a non-empty string", param=name)
    return values


class EngineAdapters:
    """A hybrid node's: its own engine, and the front's list of names."""

    def __init__(self, front: Any, engine: Any, base: str):
        self.front, self.engine, self.base = front, engine, base

    def _engine(self) -> Any:
        if not hasattr(self.engine, "load_adapter"):
            raise InvalidRequestError("this node serves no LoRA adapters: start it with "
                                      "--enable-lora or --adapter")  # fmt: skip
        return self.engine

    async def load(self, name: str, path: str) -> dict[str, Any]:
        try:
            digest = await anyio.to_thread.run_sync(self._engine().load_adapter, name, path)
        except MlxcelError as exc:
            raise InvalidRequestError(str(exc), param="lora_path") from exc
        self.front.adapters[name] = self.base
        return {"digest": digest}

    async def unload(self, name: str) -> dict[str, Any]:
        engine = self._engine()
        self.front.adapters.pop(name, None)  # new requests: 404 from now on
        await anyio.to_thread.run_sync(engine.unload_adapter, name)
        return {}


class AdapterRoutes:
    def __init__(self, manager: AdapterManager, base: str):
        self.manager, self.base = manager, base

    async def load(self, request: Request) -> JSONResponse:
        """Load a LoRA adapter (``lora_name``, ``lora_path``), then requests may name it."""
        name, path = await _fields(request, ("lora_name", "lora_path"))
        if name == self.base:
            raise InvalidRequestError("lora_name is the base model's name", param="lora_name")
        loaded = await self.manager.load(name, path)
        return JSONResponse({"lora_name": name, **loaded, "status": "loaded"})

    async def unload(self, request: Request) -> JSONResponse:
        """Unload a LoRA adapter (``lora_name``); running requests on it finish first."""
        (name,) = await _fields(request, ("lora_name",))
        unloaded = await self.manager.unload(name)
        return JSONResponse({"lora_name": name, **unloaded, "status": "unloaded"})


def install_adapter_routes(app: FastAPI, engine: Any, base: str,
                           manager: AdapterManager | None = None) -> None:  # fmt: skip
    """The two routes over ``manager`` (a router's), or else over the hybrid's ``engine``."""
    routes = AdapterRoutes(manager or EngineAdapters(app.state.front, engine, base), base)
    app.router.routes[:0] = [
        Route("/v1/load_lora_adapter", routes.load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", routes.unload, methods=["POST"]),
    ]
