"""A deterministic Engine for front tests: a token script per request, on its own thread.

Requests advance one token per step in turn (a tiny continuous batch), so
concurrent requests interleave like they do in the real engine.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    CacheState,
    EmitToken,
    EngineStats,
    GenerationRequest,
    LayerReady,
    ModelInfo,
    PrefillDone,
    TokenEvent,
)

Script = Callable[[GenerationRequest], Sequence[int]]


@dataclass
class _Live:
    request: GenerationRequest
    tokens: list[int]
    emit: EmitToken
    index: int = 0


class FakeEngine:
    def __init__(
        self,
        script: Script,
        *,
        eos_token_ids: Sequence[int] = (2,),
        context_length: int = 2048,
        token_delay_s: float = 0.0,
    ):
        self.info = ModelInfo("fake", {}, context_length, tuple(eos_token_ids), 49152)
        self.script = script
        self.token_delay_s = token_delay_s
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._live: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # Engine protocol

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def generate(self, request: GenerationRequest, emit: EmitToken) -> None:
        self.requests.append(request)
        self._inbox.put(("generate", (request, emit)))

    def prefill(
        self, request: GenerationRequest, on_done: PrefillDone, on_layer: LayerReady | None = None
    ) -> None:
        raise NotImplementedError

    def decode(
        self, request: GenerationRequest, first_token: int, cache: CacheState, emit: EmitToken
    ) -> None:
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def stats(self) -> EngineStats:
        return EngineStats(active_sequences=len(self._live))

    def live_ids(self) -> list[str]:
        return list(self._live)

    # the engine thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain_inbox(block=not self._live)
            for live in list(self._live.values()):
                self._step(live)
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
        for live in list(self._live.values()):
            self._end(live, FINISH_CANCELLED)

    def _drain_inbox(self, *, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "generate":
            request, emit = payload  # type: ignore[misc]
            self._live[request.request_id] = _Live(request, list(self.script(request)), emit)
        elif payload in self._live:
            self.cancelled.append(payload)  # type: ignore[arg-type]
            self._end(self._live[payload], FINISH_CANCELLED)  # type: ignore[index]

    def _step(self, live: _Live) -> None:
        if live.index >= len(live.tokens):
            self._end(live, FINISH_STOP)
            return
        token = live.tokens[live.index]
        live.index += 1
        stops = set(self.info.eos_token_ids) | set(live.request.stop_token_ids)
        reason = None
        if token in stops or live.index == len(live.tokens):
            reason = FINISH_STOP
        elif live.index >= live.request.max_tokens:
            reason = FINISH_LENGTH
        live.emit(TokenEvent(live.request.request_id, live.index - 1, token, reason))
        if reason is not None:
            del self._live[live.request.request_id]

    def _end(self, live: _Live, reason: str) -> None:
        self._live.pop(live.request.request_id, None)
        live.emit(TokenEvent(live.request.request_id, live.index, None, reason))
