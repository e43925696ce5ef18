"""Logging refused, unauthenticated connections cheaply: one WARNING line per interval.

Why: anyone who reaches a link port can send junk; 100 probes wrote 129 KiB
of ERROR tracebacks (websockets logs a failed upgrade with its traceback).
A refusal before authentication is counted; the first of each interval is
logged at WARNING with how many were suppressed since, tracebacks only at DEBUG.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("mlxcel_plugin.link")

REFUSAL_LOG_INTERVAL_S = 10.0
_PER_CONNECTION = frozenset({"connection open", "connection closed"})
_REJECTED = "connection rejected (%d %s)"  # websockets answered a bad upgrade with an HTTP error


class RefusalLog:
    """Rate-limited WARNING lines for connections refused before authentication."""

    def __init__(self, node_id: str, interval_s: float = REFUSAL_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.node_id, self.interval_s, self._clock = node_id, interval_s, clock
        self._last_s: float | None = None
        self.suppressed = 0  # refusals not logged since the last line
        self.total = 0

    def refused(self, peer: str, reason: str, exc_info: Any = None) -> None:
        self.total += 1
        if exc_info:
            logger.debug("link %s: refused %s: %s", self.node_id, peer, reason, exc_info=exc_info)
        now = self._clock()
        if self._last_s is not None and now - self._last_s < self.interval_s:
            self.suppressed += 1
            return
        more = (f" ({self.suppressed} more refused in the last {now - self._last_s:.0f}s)"
                if self.suppressed and self._last_s is not None else "")
        logger.warning("link %s: refused %s before authentication: %s%s", self.node_id, peer,
                       reason, more)
        self._last_s, self.suppressed = now, 0


class UpgradeLogger(logging.LoggerAdapter):
    """The ``logger`` given to websockets: its failed upgrades become ``RefusalLog`` lines.

    websockets logs "opening handshake failed" at ERROR with the traceback of
    the parse error, and "connection rejected" at INFO for a bad upgrade; its
    per-connection INFO lines go to DEBUG; the rest passes through unchanged.
    """

    def __init__(self, refusals: RefusalLog):
        super().__init__(logging.getLogger("websockets.server"), {})
        self._refusals = refusals

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        failed = level >= logging.ERROR and kwargs.get("exc_info")
        if failed or (level == logging.INFO and msg == _REJECTED):
            connection = (kwargs.get("extra") or {}).get("websocket")
            peer = _peer(getattr(connection, "remote_address", None))  # tuple or None
            reason = msg % args if args else str(msg)
            self._refusals.refused(peer, f"{reason}: {_last_error()}" if failed else reason,
                                   exc_info=kwargs.get("exc_info"))
            return
        if level == logging.INFO and msg in _PER_CONNECTION:
            level = logging.DEBUG  # one per probe too; links log their own peers
        self.logger.log(level, msg, *args, **kwargs)

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return msg, kwargs


def _last_error() -> str:
    exc = sys.exc_info()[1]
    return "?" if exc is None else f"{type(exc).__name__}: {exc}"[:200]


def _peer(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address) if address else "a peer"
