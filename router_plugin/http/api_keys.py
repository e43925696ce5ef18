"""``--api-key``: ``Authorization: Bearer KEY`` on the API, as OpenAI asks for it.

A pure ASGI middleware (Starlette's ``BaseHTTPMiddleware`` would wrap every
stream in a task and a queue). The API (``/v1/*``, ``/router/*``) needs a key;
Anthropic clients send the key as ``x-api-key``, which is accepted as well
(a 401 on ``/v1/messages*`` is Anthropic-shaped). ``/health*`` and ``/metrics``
stay open for probes and scrapers unless
``--metrics-require-key``; ``/docs`` and ``/openapi.json`` describe the API
and are open. A refusal is OpenAI's 401, counted in ``request_errors_total``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxcel_plugin.errors import AuthenticationError
from router_plugin.http.errors import error_response

OPEN_PATHS = ("/docs", "/openapi.json")
OPS_PATHS = ("/health", "/metrics")
ANTHROPIC_PATHS = ("/v1/messages",)
_BEARER = b"bearer "


def _digest(key: bytes) -> bytes:
    # Fixed-length digests: compare_digest then leaks no key length either.
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The accepted keys, checked in constant time (every key compared, no early exit)."""

    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(key.encode()) for key in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, authorization: bytes | None) -> bool:
        if authorization is None or authorization[:7].lower() != _BEARER:
            return False
        return self.accepts_key(authorization[7:].strip())

    def accepts_key(self, key: bytes | None) -> bool:
        if key is None:
            return False
        given = _digest(key)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(given, digest)
        return matched


def needs_key(path: str, *, ops_require_key: bool) -> bool:
    if path.startswith(OPEN_PATHS):
        return False
    if path.startswith(OPS_PATHS):
        return ops_require_key
    return True


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return value
    return None


def _refusal(path: str, error: AuthenticationError) -> Response:
    if path.startswith(ANTHROPIC_PATHS):
        body = {"type": "error", "error": {"type": "authentication_error",
                                           "message": error.message}}  # fmt: skip
        return JSONResponse(body, status_code=error.status_code)
    return error_response(error, {"WWW-Authenticate": "Bearer"})


class ApiKeyMiddleware:
    """Answers 401 before the app sees a request without an accepted key."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, *, ops_require_key: bool,
                 refused: Callable[[AuthenticationError], None]):  # fmt: skip
        self.app = app
        self.keys = keys
        self.ops_require_key = ops_require_key
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not needs_key(
            scope["path"], ops_require_key=self.ops_require_key
        ):
            await self.app(scope, receive, send)
            return
        if self.keys.accepts(_header(scope, b"authorization")) or self.keys.accepts_key(
            _header(scope, b"x-api-key")
        ):
            await self.app(scope, receive, send)
            return
        error = AuthenticationError(
            "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key:"
            " <key>') with a key given to --api-key"
        )
        self.refused(error)
        await _refusal(scope["path"], error)(scope, receive, send)
