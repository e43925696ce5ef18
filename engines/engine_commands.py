"""What callers queue to the MLX engine thread, and how a queued request is ended.

Callbacks are user code: a failing one drops its request, never the engine thread.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    CacheState,
    EmitToken,
    GenerationRequest,
    LayerReady,
    PrefillDone,
    RowsReady,
    TokenEvent,
)
from mlxcel_plugin.errors import EngineError

log = logging.getLogger("engines.mlx_engine")


@dataclass
class Generate:
    request: GenerationRequest
    emit: EmitToken


@dataclass
class Prefill:
    request: GenerationRequest
    on_done: PrefillDone
    on_layer: LayerReady | None
    on_rows: RowsReady | None = None  # plain KVCache layers, cell by cell (engine_api)


@dataclass
class Decode:
    request: GenerationRequest
    first_token: int
    cache: CacheState
    emit: EmitToken


@dataclass
class Cancel:
    request_id: str


class Stop:
    pass


def deliver(callback: Any, *args: Any) -> bool:
    """Call a user callback; a failing consumer must not take the engine thread down."""
    try:
        callback(*args)
    except Exception:
        log.exception("engine callback failed; dropping its request")
        return False
    return True


def cancelled_error(request_id: str) -> EngineError:
    return EngineError(f"request {request_id} was cancelled", code="cancelled")


def finish_command(command: Generate | Prefill | Decode, reason: str, exc: Exception) -> None:
    """End a request that never reached the batch: one terminal event (or on_done)."""
    request_id = command.request.request_id
    if isinstance(command, Prefill):
        deliver(command.on_done, exc)
        return
    index = 1 if isinstance(command, Decode) else 0
    error = None if reason == FINISH_CANCELLED else str(exc)
    deliver(command.emit, TokenEvent(request_id, index, None, reason, error))


def cancel_command(command: Generate | Prefill | Decode) -> None:
    finish_command(command, FINISH_CANCELLED, cancelled_error(command.request.request_id))


def cancel_queued(commands: queue.Queue[Any]) -> None:
    """After the engine thread stopped: end every request still queued to it."""
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            return
        if hasattr(command, "request"):
            cancel_command(command)
