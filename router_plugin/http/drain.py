"""Graceful drain of the HTTP roles (``router``, ``hybrid``) on SIGTERM/SIGINT.

The first signal makes readiness (``/health``, ``/health/ready``) answer 503
and new completions 503 with ``Retry-After`` (a load balancer sends them
elsewhere), while the streams already running go on; the server stops once
none is left or after ``[node] drain_timeout_s``, cancelling what remains, and
the process exits 0. ``/health/live`` answers 200 throughout. A second signal
stops at once. The node roles drain the same way (``mlxcel_plugin/nodes/drain.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxcel_plugin.errors import NodeDrainingError
from mlxcel_plugin.nodes.drain import StopSignals, wait_drained

logger = logging.getLogger(__name__)

LIVE_PATH, READY_PATH, HEALTH_PATH = "/health/live", "/health/ready", "/health"
RETRY_AFTER_S = 1


class DrainGate:
    """ASGI wrapper of the front: liveness and readiness probes, no new work once draining."""

    def __init__(self, app: ASGIApp, front: Any):
        self.app, self.front = app, front  # front: its health() is readiness when not draining
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = self._answer(scope) if scope["type"] == "http" else None
        if response is None:
            await self.app(scope, receive, send)
        else:
            await response(scope, receive, send)

    def _answer(self, scope: Scope) -> Response | None:
        path = scope["path"]
        if path == LIVE_PATH:
            return JSONResponse({"status": "ok"})
        if self.draining and path in (HEALTH_PATH, READY_PATH):
            return JSONResponse({"status": "draining"}, status_code=503)
        if path == READY_PATH:
            return self.front.health()
        if self.draining and scope["method"] == "POST" and path.startswith("/v1/"):
            error = NodeDrainingError("the server is draining; retry on another replica")
            return Response(json.dumps(error.to_openai()), 503, media_type="application/json",
                            headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        return None


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGTERM/SIGINT drain first: in-flight requests finish, then it stops."""

    def __init__(self, config: uvicorn.Config, gate: DrainGate, drain_timeout_s: float):
        super().__init__(config)
        self.gate, self.drain_timeout_s = gate, drain_timeout_s

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Entered inside serve(), on the running loop; replaces uvicorn's handlers, which
        # would stop at once and re-raise the signal (exit status 143 instead of 0).
        with StopSignals().installed() as signals:
            task = asyncio.get_running_loop().create_task(self._drain_on(signals), name="drain")
            try:
                yield
            finally:
                task.cancel()

    def in_flight(self) -> int:
        """HTTP requests being answered (uvicorn's running request tasks)."""
        return len(self.server_state.tasks)

    async def _drain_on(self, signals: StopSignals) -> None:
        await signals.drain.wait()
        self.gate.draining = True
        logger.info("draining: %d request(s) in flight, at most %.0fs", self.in_flight(),
                    self.drain_timeout_s)
        left = await wait_drained(self.in_flight, self.drain_timeout_s, signals.stop_now)
        if left:
            logger.warning("%d request(s) still in flight after the drain; cancelling them", left)
        self.should_exit = True
        if signals.stop_now.is_set():
            self.force_exit = True
        await signals.stop_now.wait()  # a later signal still stops at once
        self.force_exit = True
