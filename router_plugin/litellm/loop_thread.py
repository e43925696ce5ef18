"""A private event loop on a daemon thread: LiteLLM's sync entry points share one cluster."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


# Coroutines, not bare awaitables: run_coroutine_threadsafe accepts nothing else.
async def _next_or(items: AsyncIterator[T], default: Any) -> T | Any:
    return await anext(items, default)


async def _aclose(items: AsyncIterator[Any]) -> None:
    await items.aclose()  # type: ignore[attr-defined]


class LoopThread:
    """A private event loop on a daemon thread, for LiteLLM's sync entry points."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._loop is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:  # two sync callers at once must not start two loops
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever,
                                                name="mlxcel-litellm", daemon=True)  # fmt: skip
                self._thread.start()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        finally:
            future.cancel()  # a no-op when done; stops the work if the caller was interrupted

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        """``items`` consumed on the loop thread; closing this generator closes them."""
        done = object()
        try:
            while (item := self.run(_next_or(items, done))) is not done:  # ends with the stream
                yield item  # type: ignore[misc]
        finally:
            self.run(_aclose(items))

    def close(self, timeout_s: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None
