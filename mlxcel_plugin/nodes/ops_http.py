"""A minimal HTTP server for ``GET /health`` and ``GET /metrics`` (no FastAPI here).

One request per connection (``Connection: close``); request heads are bounded
and time-limited, so a slow or hostile client costs one small task.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
HEAD_TIMEOUT_S = 5.0
JSON_TYPE = "application/json"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


@dataclass(frozen=True)
class OpsRoutes:
    health: Callable[[], dict[str, Any]]
    metrics: Callable[[], tuple[bytes, str]]  # (body, content type)


def parse_request_line(head: bytes) -> tuple[str, str] | None:
    """(method, path without query) from a request head, or None when malformed."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return None
    return parts[0], parts[1].split("?", 1)[0]


def respond(routes: OpsRoutes, method: str, path: str) -> tuple[int, bytes, str]:
    """(status, body, content type) for one request (pure)."""
    if path not in ("/health", "/metrics"):
        return 404, b'{"error": "not found"}', JSON_TYPE
    if method not in ("GET", "HEAD"):
        return 405, b'{"error": "method not allowed"}', JSON_TYPE
    if path == "/health":
        return 200, json.dumps(routes.health()).encode(), JSON_TYPE
    body, content_type = routes.metrics()
    return 200, body, content_type


def render(status: int, body: bytes, content_type: str, *, head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


async def _serve_one(routes: OpsRoutes, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
    try:
        async with asyncio.timeout(HEAD_TIMEOUT_S):
            head = await reader.readuntil(b"\r\n\r\n")
        request = parse_request_line(head)
        if request is None:
            writer.write(render(400, b'{"error": "bad request"}', JSON_TYPE))
        else:
            status, body, content_type = respond(routes, *request)
            writer.write(render(status, body, content_type, head_only=request[0] == "HEAD"))
        await writer.drain()
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ConnectionError) as exc:
        logger.debug("ops http: dropped a connection: %s", type(exc).__name__)
    finally:
        writer.close()


async def serve_ops_http(host: str, port: int, routes: OpsRoutes) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _serve_one(routes, reader, writer)

    return await asyncio.start_server(handle, host, port, limit=MAX_HEAD_BYTES)
