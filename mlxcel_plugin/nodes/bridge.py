"""Engine callbacks run on the engine thread; node state lives on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any]) -> Callable[..., None]:
    """A thread-safe wrapper: calling it schedules ``callback(*args)`` on ``loop``."""

    def hop(*args: Any) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(callback, *args)

    return hop
