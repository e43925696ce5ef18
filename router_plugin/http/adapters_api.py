"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's shape).

Body: ``{"lora_name": NAME, "lora_path": PATH}`` (unload: ``lora_name`` only), and
optionally ``base_model_name`` (vLLM's name for an adapter's base: on a router serving
several models, the pool that loads it; ``model_dispatch``); behind the API key like
every ``/v1/*`` route. On a hybrid node the engine
loads the adapter between decode steps (``engines/lora/engine.py``); on a
router every prefill and decode node of the pool does
(``router_plugin/cluster/adapter_commands.py``). Once it answers, requests may
name ``NAME`` as their ``model``. After an unload a request naming it gets 404
``model_not_found``, while requests already running finish on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.routing import Route

from mlxcel_plugin.errors import InvalidRequestError, MlxcelError, ModelNotFoundError

MAX_BODY_BYTES = 64 * 1024


class AdapterManager(Protocol):
    """Loads and unloads adapters where requests run (one engine, or every node)."""

    async def load(self, name: str, path: str) -> dict[str, Any]: ...  # {"digest": ...}

    async def unload(self, name: str) -> dict[str, Any]: ...


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw[:MAX_BODY_BYTES]) if len(raw) <= MAX_BODY_BYTES else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return body


def _fields(body: dict[str, Any], names: tuple[str, ...]) -> list[str]:
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
        # The model or pool that already serves a name, beside this one (a router over several
        # models sets it): an adapter of that name here would be shadowed there, or shadow it.
        self.served_elsewhere: Callable[[str], str | None] = lambda name: None

    def _check_base(self, body: dict[str, Any]) -> None:
        base = body.get("base_model_name", self.base)
        if base != self.base:
            raise ModelNotFoundError(
                f"the base model {base!r} is not served here; GET /v1/models lists those served",
                param="base_model_name",
            )

    def _check_name(self, name: str) -> None:
        if name == self.base:
            raise InvalidRequestError("lora_name is the base model's name", param="lora_name")
        elsewhere = self.served_elsewhere(name)
        if elsewhere is not None:
            raise InvalidRequestError(f"lora_name {name!r} is already served by {elsewhere!r}",
                                      param="lora_name")  # fmt: skip

    async def load(self, request: Request) -> JSONResponse:
        """Load a LoRA adapter (``lora_name``, ``lora_path``), then requests may name it."""
        body = await _body(request)
        name, path = _fields(body, ("lora_name", "lora_path"))
        self._check_base(body)
        self._check_name(name)
        loaded = await self.manager.load(name, path)
        return JSONResponse({"lora_name": name, **loaded, "status": "loaded"})

    async def unload(self, request: Request) -> JSONResponse:
        """Unload a LoRA adapter (``lora_name``); running requests on it finish first."""
        body = await _body(request)
        (name,) = _fields(body, ("lora_name",))
        self._check_base(body)
        unloaded = await self.manager.unload(name)
        return JSONResponse({"lora_name": name, **unloaded, "status": "unloaded"})


def install_adapter_routes(app: FastAPI, engine: Any, base: str,
                           manager: AdapterManager | None = None) -> None:  # fmt: skip
    """The two routes over ``manager`` (a router's), or else over the hybrid's ``engine``."""
    routes = AdapterRoutes(manager or EngineAdapters(app.state.front, engine, base), base)
    app.state.adapter_routes = routes  # a several-model dispatcher sets its served_elsewhere
    app.router.routes[:0] = [
        Route("/v1/load_lora_adapter", routes.load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", routes.unload, methods=["POST"]),
    ]
