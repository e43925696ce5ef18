"""A byte budget for a link's send queue: ``send`` waits while the queued bytes are spent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ByteBudget:
    """Bytes queued or in flight; ``acquire`` waits while the budget is spent."""

    def __init__(self, limit: int):
        self._limit, self.used = limit, 0
        self._changed = asyncio.Event()

    async def acquire(self, n: int, is_open: Callable[[], bool]) -> None:
        while is_open() and not self._fits(n):  # ends on release/close
            self._changed.clear()
            await self._changed.wait()
        self.used += n

    def take(self, n: int) -> None:
        """Count ``n`` bytes without waiting (what the caller sends whatever the budget holds)."""
        self.used += n

    def try_acquire(self, n: int) -> bool:
        if not self._fits(n):
            return False
        self.used += n
        return True

    def _fits(self, n: int) -> bool:
        # A frame bigger than the whole budget still goes, alone.
        return not self.used or self.used + n <= self._limit

    def release(self, n: int) -> None:
        self.used -= n
        self._changed.set()

    def wake_all(self) -> None:
        self._changed.set()
