"""One HTTP front over several models: each request goes to its model's app by ``model``.

Each served model has a whole router app of its own (``roles.make_router_app``:
tokenizer, cluster backend, balancers, prefix index, admission, metrics); this
ASGI app in front of them reads a generation request's body once, picks the app
by the body's ``model`` and replays the body to it. A body without a ``model``
goes to the default (first) model; a LoRA adapter's name to the pool whose nodes
hold it; an unknown one to the default app too, which checks the API key and then
answers OpenAI's 404 ``model_not_found``. ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` go to the pool their body's ``base_model_name`` names, else
to the pool serving ``lora_name``, else to the default pool; no pool may load an adapter
named as another model or as another pool's adapter (each name routes to one pool).
``/v1/models`` and ``/metrics`` merge every model's answer; other GET routes
(``/router/stats``) take ``?model=NAME`` and default to the first model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from functools import partial
from typing import Any
from urllib.parse import parse_qs

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message, Receive, Scope, Send

from mlxcel_plugin.errors import MlxcelError
from router_plugin.http.errors import error_response
from router_plugin.http.merged_metrics import merge_expositions
from router_plugin.http.request_limits import read_body

# The POST routes whose body names the model.
MODEL_ROUTES = frozenset((
    "/v1/chat/completions", "/v1/completions", "/v1/responses",
    "/v1/messages", "/v1/messages/count_tokens",
))  # fmt: skip
# The POST routes whose body names an adapter (and, optionally, its base).
ADAPTER_ROUTES = frozenset(("/v1/load_lora_adapter", "/v1/unload_lora_adapter"))
# A body this big is parsed for its model in a worker thread: the loop serves other streams.
OFF_LOOP_BYTES = 256 * 1024


def _names_in(raw: bytes) -> dict[str, str]:
    """The body's top-level string fields (none for a bad body: its model's front answers)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(body, dict):
        return {}
    return {key: value for key, value in body.items() if isinstance(value, str)}


def model_cards(bodies: list[bytes]) -> list[dict[str, Any]]:
    """Every model card of several ``/v1/models`` answers, in order."""
    return [card for body in bodies for card in json.loads(body)["data"]]


def _replay(raw: bytes, receive: Receive) -> Receive:
    """The body once, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return replayed


async def _collect(app: FastAPI, scope: Scope) -> tuple[int, bytes, list[Any]]:
    """A GET answered by ``app`` in-process: (status, body, headers)."""
    status, headers, chunks = 500, [], []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], message.get("headers", [])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks), headers


class ModelDispatcher:
    """The ASGI app of a router serving several models (``apps``: name -> router app)."""

    def __init__(self, apps: Mapping[str, FastAPI], *, max_request_bytes: int):
        if not apps:
            raise ValueError("a dispatcher needs at least one model")
        self.apps = dict(apps)
        self.default = next(iter(self.apps))
        self.max_request_bytes = max_request_bytes
        for name, app in self.apps.items():
            routes = getattr(app.state, "adapter_routes", None)
            if routes is not None:
                routes.served_elsewhere = partial(self.served_elsewhere, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] != "http":
            await self.apps[self.default](scope, receive, send)
        elif scope["method"] == "POST" and scope["path"] in MODEL_ROUTES:
            await self._by_body(scope, receive, send, self._model_app)
        elif scope["method"] == "POST" and scope["path"] in ADAPTER_ROUTES:
            await self._by_body(scope, receive, send, self._adapter_app)
        elif scope["method"] == "GET" and scope["path"] == "/v1/models":
            await self._merged(scope, send, self._merge_models)
        elif scope["method"] == "GET" and scope["path"] == "/metrics":
            await self._merged(scope, send, self._merge_metrics)
        else:
            await self.apps[self._by_query(scope)](scope, receive, send)

    def health(self) -> Response:
        """Ready while any model's pool is (a model without nodes answers its own 503s)."""
        answers = [app.state.front.health() for app in self.apps.values()]
        return next((a for a in answers if a.status_code == 200), answers[0])

    def app_for(self, model: str | None) -> FastAPI:
        """The app serving ``model``: a model by its name, or the pool holding the adapter."""
        if model is None or model in self.apps:
            return self.apps[model or self.default]
        for app in self.apps.values():
            if model in app.state.front.adapters:  # a LoRA adapter over that pool's base
                return app
        return self.apps[self.default]

    def served_elsewhere(self, pool: str, name: str) -> str | None:
        """The other model (or the pool of the adapter) serving ``name``, beside ``pool``."""
        if name in self.apps and name != pool:
            return name
        return next((other for other, app in self.apps.items()
                     if other != pool and name in app.state.front.adapters), None)  # fmt: skip

    def _model_app(self, body: dict[str, str]) -> FastAPI:
        return self.app_for(body.get("model"))

    def _adapter_app(self, body: dict[str, str]) -> FastAPI:
        """An adapter's load or unload: the pool of its base, else the one serving it."""
        base = body.get("base_model_name")
        if base is not None:  # an unknown base: the default app answers 404 after the key
            return self.apps.get(base, self.apps[self.default])
        return self.app_for(body.get("lora_name"))  # a model's name: its pool says no

    async def _by_body(self, scope: Scope, receive: Receive, send: Send,
                       pick: Callable[[dict[str, str]], FastAPI]) -> None:  # fmt: skip
        try:
            raw = await read_body(Request(scope, receive), self.max_request_bytes)
        except ClientDisconnect:
            return
        except MlxcelError as exc:
            await error_response(exc)(scope, receive, send)
            return
        if len(raw) < OFF_LOOP_BYTES:
            body = _names_in(raw)
        else:
            body = await anyio.to_thread.run_sync(_names_in, raw)
        await pick(body)(scope, _replay(raw, receive), send)

    def _by_query(self, scope: Scope) -> str:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        names = query.get("model", [])
        return names[0] if names and names[0] in self.apps else self.default

    async def _merged(self, scope: Scope, send: Send, merge: Any) -> None:
        answers = [await _collect(app, scope) for app in self.apps.values()]
        refused = next((a for a in answers if a[0] != 200), None)
        if refused is not None:  # the API key's 401, say: passed on as it is
            status, body, headers = refused
            response = Response(body, status, headers={k.decode(): v.decode() for k, v in headers})
        else:
            response = merge([body for _, body, _ in answers])
        await response(scope, _no_receive, send)

    def _merge_models(self, bodies: list[bytes]) -> Response:
        return JSONResponse({"object": "list", "data": model_cards(bodies)})

    def _merge_metrics(self, bodies: list[bytes]) -> Response:
        text, content_type = merge_expositions(dict(zip(self.apps, bodies, strict=True)))
        return Response(text, media_type=content_type)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Every model's lifespan (peers, health, discovery) entered and left together."""
        await receive()  # lifespan.startup
        async with AsyncExitStack() as stack:
            try:
                for app in self.apps.values():
                    await stack.enter_async_context(app.router.lifespan_context(app))
            except Exception as exc:  # noqa: BLE001 - reported to the server, which stops
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
