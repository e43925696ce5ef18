"""Helpers for engine tests: collect events on the engine thread, wait on the test thread."""

from __future__ import annotations

import threading

from mlxcel_plugin.engine_api import Engine, GenerationRequest, PrefillResult, TokenEvent

WAIT_S = 60.0


class Events:
    """An ``emit`` callback that records events and signals the terminal one."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()

    def wait(self) -> list[TokenEvent]:
        if not self.done.wait(WAIT_S):
            raise TimeoutError(f"no terminal event after {WAIT_S}s: {self.events}")
        return self.events

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if e.token_id is not None]

    @property
    def last(self) -> TokenEvent:
        return self.events[-1]


class PrefillOutcome:
    """``on_done`` + ``on_layer`` callbacks for ``Engine.prefill``."""

    def __init__(self) -> None:
        self.result: PrefillResult | Exception | None = None
        self.layer_order: list[int] = []
        self.done = threading.Event()

    def on_layer(self, i: int, layer: object) -> None:
        self.layer_order.append(i)

    def on_done(self, result: PrefillResult | Exception) -> None:
        self.result = result
        self.done.set()

    def wait(self) -> PrefillResult | Exception:
        if not self.done.wait(WAIT_S):
            raise TimeoutError("prefill did not finish")
        return self.result


def generate(engine: Engine, request: GenerationRequest) -> Events:
    events = Events()
    engine.generate(request, events)
    events.wait()
    return events


def prefill(engine: Engine, request: GenerationRequest) -> PrefillResult:
    outcome = PrefillOutcome()
    engine.prefill(request, outcome.on_done, outcome.on_layer)
    result = outcome.wait()
    if isinstance(result, Exception):
        raise result
    return result


def decode_after(engine: Engine, request: GenerationRequest, result: PrefillResult) -> list[int]:
    """Tokens of a split run: the prefill's first token, then the decode node's."""
    if result.finish_reason is not None:
        return [result.first_token]
    events = Events()
    engine.decode(request, result.first_token, result.cache, events)
    events.wait()
    return [result.first_token, *events.tokens]


def split(engine: Engine, request: GenerationRequest) -> list[int]:
    return decode_after(engine, request, prefill(engine, request))
