"""Engine-thread callbacks → the event loop, in order, with one wakeup per burst.

Engines call back on their own thread; node and front state lives on the loop.
Each ``call_soon_threadsafe`` writes the loop's self-pipe and hands the GIL to
the loop and back, so a decode step that emits a token for every sequence in
the batch (or a prefill that reports its layers and first token at once) wakes
the loop once, not once per event.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class EngineMailbox(Generic[T]):
    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[T], None]):
        self._loop, self._deliver = loop, deliver
        self._items: collections.deque[T] = collections.deque()
        self._wake_pending = False

    def put(self, item: T) -> None:
        """Any thread. Appending before reading the flag: a drain never misses an item."""
        self._items.append(item)
        if not self._wake_pending and not self._loop.is_closed():
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:
                pass  # the loop closed since the check: nobody is left to read this

    def _drain(self) -> None:
        self._wake_pending = False  # before taking items: a put from now on wakes us again
        items = self._items
        while items:  # bounded: puts that race in here are delivered in this pass
            self._deliver(items.popleft())
