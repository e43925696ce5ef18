"""Driving an engine from a test, and checking what it emits: reuse these in your own tests.

``EngineContract`` (``engine_contract``) is built from these: ``EventLog`` and
``PrefillOutcome`` record an engine's callbacks, ``make_request`` draws prompts
from ``info.vocab_size``, ``through_the_wire`` sends a prefill's cache through the
KV wire format as a decode node receives it, and the ``check_*`` functions assert
the rules the contract states.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    CacheLayer,
    CacheState,
    Engine,
    EngineStats,
    GenerationRequest,
    ModelInfo,
    PrefillResult,
    SamplingParams,
    TokenEvent,
    kv_buffer_maker,
    layer_adopter,
)
from mlxcel_plugin.kv_serde import (
    HandoffHeader,
    KVAssembler,
    ModelFingerprint,
    ReceiveMemory,
    SerializableSamplingState,
    assemble_messages,
)
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec
from mlxcel_plugin.transfer import FullTransfer, StrategyOptions, plan_transfer

EngineFactory = Callable[[], Engine]

WAIT_S = 120.0  # generous: contract runs share small CI machines
POLL_S = 0.005
PROMPT_TOKENS = 37
FIRST_TOKEN_ID = 3  # low ids are often BOS/EOS/pad; prompts avoid them
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234)
TERMINAL_REASONS = {FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR}


class EventLog:
    """An ``emit`` callback recording events; ``wait`` blocks until the terminal one."""

    def __init__(self, on_event: Callable[[TokenEvent], None] | None = None) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()
        self._on_event = on_event

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()
        if self._on_event is not None:
            self._on_event(event)

    def wait(self, timeout_s: float = WAIT_S) -> EventLog:
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"no terminal event after {timeout_s}s: {self.events[-5:]}")
        return self

    def wait_for_events(self, count: int, timeout_s: float = WAIT_S) -> None:
        wait_until(lambda: len(self.events) >= count or self.done.is_set(), timeout_s)

    @property
    def tokens(self) -> list[int]:
        return [event.token_id for event in self.events if event.token_id is not None]

    @property
    def terminal(self) -> TokenEvent:
        return self.events[-1]


class PrefillOutcome:
    """``on_layer`` and ``on_done`` callbacks for ``Engine.prefill``."""

    def __init__(self) -> None:
        self.layers: list[tuple[int, CacheLayer]] = []
        self.result: PrefillResult | Exception | None = None
        self.done_calls = 0
        self.done = threading.Event()

    def on_layer(self, index: int, layer: CacheLayer) -> None:
        self.layers.append((index, layer))

    def on_done(self, result: PrefillResult | Exception) -> None:
        self.done_calls += 1
        self.result = result
        self.done.set()

    def wait(self, timeout_s: float = WAIT_S) -> PrefillResult | Exception:
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"prefill did not finish in {timeout_s}s")
        return self.result


def wait_until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not reached in {timeout_s}s")
        time.sleep(POLL_S)


def make_prompt(info: ModelInfo, length: int, seed: int = 0) -> tuple[int, ...]:
    """Token ids the model accepts (``FIRST_TOKEN_ID`` .. vocab, no EOS ids)."""
    high = info.vocab_size or 1000
    rng = np.random.default_rng(seed)
    tokens = rng.integers(FIRST_TOKEN_ID, high, size=length)
    return tuple(int(t) for t in tokens if int(t) not in info.eos_token_ids) or (FIRST_TOKEN_ID,)


def make_request(
    info: ModelInfo,
    request_id: str,
    max_tokens: int = 8,
    prompt_tokens: int = PROMPT_TOKENS,
    **fields: object,
) -> GenerationRequest:
    prompt = make_prompt(info, prompt_tokens, seed=prompt_tokens)
    return GenerationRequest(request_id, prompt, max_tokens, **fields)


def long_request(info: ModelInfo, request_id: str) -> GenerationRequest:
    """A request that runs until cancelled (as long as the context allows)."""
    room = info.context_length - PROMPT_TOKENS - 1
    return make_request(info, request_id, max_tokens=max(2, min(room, 100_000)))


def generate(engine: Engine, request: GenerationRequest) -> EventLog:
    log = EventLog()
    engine.generate(request, log)
    return log.wait()


def prefill(engine: Engine, request: GenerationRequest) -> tuple[PrefillResult, PrefillOutcome]:
    outcome = PrefillOutcome()
    engine.prefill(request, outcome.on_done, outcome.on_layer)
    result = outcome.wait()
    if isinstance(result, Exception):
        raise AssertionError(f"prefill of a valid request failed: {result!r}") from result
    return result, outcome


def wait_idle(engine: Engine, timeout_s: float = WAIT_S) -> EngineStats:
    """Wait until the engine holds nothing: no queue, no sequence, no KV but its prefix cache."""

    def idle() -> bool:
        stats = engine.stats()
        requests_kv = stats.kv_bytes - stats.prefix_cache.cached_bytes
        return stats.queued == 0 and stats.active_sequences == 0 and requests_kv == 0

    wait_until(idle, timeout_s)
    return engine.stats()


def check_stream(log: EventLog, first_index: int, max_tokens: int) -> None:
    """Indexes ``first_index``, +1, ...; exactly one terminal event, last; budget kept."""
    events = log.events
    assert events, "no events"
    indexes = [event.index for event in events]
    assert indexes == list(range(first_index, first_index + len(events))), indexes
    terminals = [event for event in events if event.finish_reason is not None]
    assert terminals == [events[-1]], f"one terminal event, last: {terminals}"
    assert events[-1].finish_reason in TERMINAL_REASONS, events[-1]
    assert all(event.token_id is not None for event in events[:-1]), "only the end may be tokenless"
    assert first_index + len(log.tokens) <= max_tokens, f"{len(log.tokens)} > max_tokens"


def check_natural_end(log: EventLog, info: ModelInfo, request: GenerationRequest) -> None:
    """A request that was not cancelled ends on a token, for the right reason."""
    end = log.terminal
    assert end.finish_reason in (FINISH_STOP, FINISH_LENGTH), end
    assert end.token_id is not None, "stop/length carry the token that ended the request"
    if end.finish_reason == FINISH_STOP:
        assert end.token_id in {*info.eos_token_ids, *request.stop_token_ids}, end
    elif end.index + 1 < request.max_tokens:
        # Only the model's context may cut a request short of max_tokens.
        used = len(request.prompt_tokens) + end.index + 1
        assert used >= info.context_length, f"length before max_tokens: {end}"


def check_cache_matches(cache: CacheState, fingerprint: dict, prompt_length: int) -> None:
    """Layers, kinds, dtype, arrays and offsets as ``info.fingerprint`` declares them."""
    parsed = ModelFingerprint.from_dict(fingerprint)
    assert isinstance(cache, CacheState), type(cache)
    assert len(cache.layers) == parsed.num_layers
    for index, (layer, spec) in enumerate(zip(cache.layers, parsed.layers, strict=True)):
        assert layer.kind == spec.kind, f"layer {index}: {layer.kind} is not {spec.kind}"
        assert layer.keys is None or layer.dtype == parsed.dtype, f"layer {index}: {layer.dtype}"
        assert layer.offset == prompt_length, f"layer {index}: offset {layer.offset}"
        assert set(layer.arrays()) == set(spec.names), f"layer {index}: {list(layer.arrays())}"
        for array_spec in spec.arrays:
            check_layer_tensor(index, layer, layer.array(array_spec.name), array_spec)


def check_layer_tensor(index: int, layer: CacheLayer, tensor: np.ndarray, spec: ArraySpec) -> None:
    assert isinstance(tensor, np.ndarray), f"layer {index}: arrays must be numpy arrays"
    assert tensor.dtype == spec.storage, f"layer {index} {spec.name}: {tensor.dtype}"
    axis = spec.grow_axis
    tokens = tensor.shape[axis] if axis is not None and tensor.ndim > axis else 1
    assert tensor.shape == spec.shape_for(tokens), f"layer {index} {spec.name}: {tensor.shape}"
    # A KVCache is sliced to its offset; a RotatingKVCache keeps at most its window.
    held_ok = tokens == layer.offset if layer.kind == "KVCache" else tokens <= layer.offset
    assert held_ok, f"layer {index}: {tokens} positions held for offset {layer.offset}"


def through_the_wire(
    result: PrefillResult, info: ModelInfo, receiver: Engine | None = None,
    prefix_tokens: int = 0,
) -> CacheState:
    """The cache as a decode node receives it: serialized, then assembled and checked.

    With ``receiver`` (the decode engine), as a decode node does it: into that
    engine's memory (``kv_buffers``) and arrays (``adopt_layer``) where it offers them.
    ``prefix_tokens``: a delta handoff, whose layers carry the positions after it only.
    """
    fingerprint = ModelFingerprint.from_dict(info.fingerprint)
    request = result.request
    header = HandoffHeader(
        request_id=request.request_id,
        handoff_id=f"{request.request_id}-h",
        epoch=0,
        fingerprint=fingerprint,
        prompt_length=len(request.prompt_tokens),
        first_token=result.first_token,
        sampling=SerializableSamplingState.from_request(request),
        prefix_tokens=prefix_tokens,
    )
    messages = plan_transfer(FullTransfer(StrategyOptions()), header, result.cache)
    if receiver is None:
        return assemble_messages(messages, fingerprint, builtin_codecs()).cache
    memory = ReceiveMemory(make_buffers=kv_buffer_maker(receiver))
    assembler = KVAssembler(fingerprint, builtin_codecs(), memory=memory,
                            adopt=layer_adopter(receiver))
    states = [state for state in map(assembler.feed, messages) if state is not None]
    assert len(states) == 1, "the handoff did not complete exactly once"
    return states[0].cache


def busy(stats: EngineStats) -> bool:
    return stats.active_sequences + stats.queued >= 1


def check_stats(stats: EngineStats) -> None:
    assert isinstance(stats, EngineStats)
    for name in ("queued", "active_sequences", "kv_bytes"):
        value = getattr(stats, name)
        assert isinstance(value, int) and value >= 0, f"{name}={value!r}"
    assert 0.0 <= stats.free_kv_fraction <= 1.0, stats
    assert stats.tokens_per_s >= 0.0, stats
    # A prefix cache counts inside the KV an engine reports.
    assert 0 <= stats.prefix_cache.cached_bytes <= stats.kv_bytes, stats
