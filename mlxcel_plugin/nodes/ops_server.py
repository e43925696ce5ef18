"""``GET /health`` and ``GET /metrics`` of a prefill or decode node (uvicorn + Starlette).

``/health`` is readiness (as ``/health/ready``): 503 once the node drains;
``/health/live`` stays 200 while the process serves at all.

The server runs on the node's own event loop, beside its links. Request heads are
bounded in size and in time, and connections in number, so a slow or hostile client
costs one small, short-lived connection; every error is a short OpenAI-shaped JSON body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

JSON_TYPE = "application/json"
_ERROR_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
                500: "internal_error"}


@dataclass(frozen=True)
class OpsRoutes:
    health: Callable[[], dict[str, Any]]
    metrics: Callable[[], tuple[bytes, str]]  # (body, content type)
    ready: Callable[[], bool] = lambda: True  # False while draining: readiness answers 503


@dataclass(frozen=True)
class OpsLimits:
    max_head_bytes: int = 16 * 1024  # a head still incomplete beyond this is a 400
    # A request head must arrive whole this soon after connecting or after the last response.
    head_timeout_s: float = 5.0
    max_connections: int = 64  # with this many open, requests get uvicorn's plain-text 503


def error_body(status: int, message: str) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}``, as every other endpoint's errors."""
    error_type = "invalid_request_error" if status < 500 else "server_error"
    code = _ERROR_CODES.get(status, "http_error")
    return json.dumps({"error": {"message": message, "type": error_type, "param": None,
                                 "code": code}}).encode()


# -- the application ------------------------------------------------------------------


def ops_app(routes: OpsRoutes) -> Starlette:
    """``/health`` (JSON), ``/health/ready``, ``/health/live`` and ``/metrics`` (the exposition
    format); GET and HEAD only."""

    async def health(_: Request) -> Response:
        # json.dumps, not JSONResponse: a NaN estimate must not turn health into a 500.
        if routes.ready():
            return Response(json.dumps(routes.health()), media_type=JSON_TYPE)
        body = {**routes.health(), "status": "draining"}
        return Response(json.dumps(body), 503, media_type=JSON_TYPE)

    async def live(_: Request) -> Response:
        return Response(json.dumps({"status": "ok"}), media_type=JSON_TYPE)

    async def metrics(_: Request) -> Response:
        body, content_type = routes.metrics()
        return Response(body, media_type=content_type)

    async def on_http_error(_: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        headers = exc.headers if isinstance(exc, HTTPException) else None  # 405's Allow
        message = exc.detail if isinstance(exc, HTTPException) else "internal server error"
        return Response(error_body(status, message), status, headers, JSON_TYPE)

    app = Starlette(routes=[Route("/health", health, methods=["GET"]),
                            Route("/health/ready", health, methods=["GET"]),
                            Route("/health/live", live, methods=["GET"]),
                            Route("/metrics", metrics, methods=["GET"])],
                    exception_handlers={HTTPException: on_http_error, Exception: on_http_error})
    app.router.redirect_slashes = False  # /health/ is unknown, not a redirect
    return app


# -- the protocol ---------------------------------------------------------------------


class _OpsProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head, and JSON 400s.

    uvicorn arms its keep-alive timer only after a response, and disarms it on the
    first byte; here it runs from the connection's start until a whole head is parsed,
    so a client dribbling a head forever is dropped (``timeout_keep_alive`` is the
    head timeout).
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        self.conn.receive_data(data)
        self.handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._unset_keepalive_if_required()  # a whole head is in: its request runs

    def send_400_response(self, msg: str) -> None:
        body = error_body(400, msg)
        headers = [(b"content-type", JSON_TYPE.encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class _NodeOwnedServer(uvicorn.Server):
    """The node handles SIGTERM/SIGINT itself; uvicorn must not take them over."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


# -- the server -----------------------------------------------------------------------


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names (as ``asyncio.start_server``).

    Bound here rather than by uvicorn, which exits the process when a bind fails;
    here a taken port raises ``OSError`` to the caller.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen()  # clients queue from now on, before uvicorn's first accept
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class OpsServer:
    """``ops_app`` served by uvicorn in a task of the running loop; ``close`` frees the port."""

    def __init__(self, routes: OpsRoutes, sockets: list[socket.socket], limits: OpsLimits):
        config = uvicorn.Config(
            ops_app(routes), http=_OpsProtocol, ws="none", lifespan="off", log_config=None,
            log_level="warning", access_log=False, proxy_headers=False, server_header=False,
            h11_max_incomplete_event_size=limits.max_head_bytes,
            timeout_keep_alive=limits.head_timeout_s,  # type: ignore[arg-type]
            limit_concurrency=limits.max_connections,
            timeout_graceful_shutdown=max(1, round(limits.head_timeout_s)))
        self.address: tuple[str, int] = sockets[0].getsockname()[:2]
        self._server = _NodeOwnedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets), name="ops-server")
        self._task.add_done_callback(self._on_done)

    @classmethod
    async def start(cls, host: str, port: int, routes: OpsRoutes,
                    limits: OpsLimits = OpsLimits()) -> OpsServer:
        return cls(routes, bind_sockets(host, port), limits)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("ops server stopped: %r", task.exception())

    async def close(self) -> None:
        """Stop accepting, let open requests finish, close the sockets; idempotent."""
        self._server.should_exit = True
        if not self._task.done():  # a task that ended by itself was logged in _on_done
            await self._task
