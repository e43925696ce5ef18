"""Serving a response while watching for the client to go away.

``run_until_disconnect`` cancels the work (running its cleanup) when the
client disconnects; ``SSEResponse`` always closes its body iterator, so the
engine (or the remote nodes) cancel a stream nobody reads any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Send

from router_plugin.http import sse

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def _until_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` in this task; cancel it (running its cleanup) if the client goes away.

    Run here rather than in a task of its own: the first token wakes the handler
    directly, one loop turn sooner.
    """
    with anyio.CancelScope() as scope:

        async def watch() -> None:
            await _until_disconnect(request)
            scope.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            return await work
        finally:
            watcher.cancel()
            # Usually it only waits on receive(): nothing to wait for, just reap it.
            watcher.add_done_callback(_retrieve)
    raise ClientDisconnected()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # seen: no "exception was never retrieved" warning


class SSEResponse(StreamingResponse):
    """A stream whose body iterator is always closed, even on disconnect."""

    media_type = sse.MEDIA_TYPE

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            # Shielded: the cleanup (engine cancel) must run inside a cancelled scope too.
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
