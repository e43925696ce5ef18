"""A zero-cost, deterministic Engine (registered as engine ``"fake"``).

It implements the whole ``Engine`` protocol — generate, prefill (with
``on_layer``), decode of a handed-off cache, cancel, stats — on its own
thread, like the MLX engine, so node tests and the router-overhead benchmark
run without MLX.

Tokens are a pure function of (prompt, position, seed), so one node and two
agree. The cache encodes the prompt: layer ``l`` holds ``prompt[t] + l`` in
every K/V row of token ``t`` (float32, exact). ``decode`` reads the prompt
back *from the cache*, so a cache damaged in transit decodes different tokens
(or is refused) instead of passing silently.

Knobs come from ``fake_engine.json`` in the "model" directory (all optional)::

    {"num_layers": 4, "kv_heads": 2, "head_dim": 8, "prefill_s_per_token": 0.0,
     "decode_step_s": 0.0, "context_length": 4096}
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    CacheLayer,
    CacheState,
    EmitToken,
    EngineConfig,
    EngineStats,
    GenerationRequest,
    LayerReady,
    ModelInfo,
    PrefillDone,
    PrefillResult,
    TokenEvent,
)
from mlxcel_plugin.errors import (
    AtCapacityError,
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    MlxcelError,
)

CONFIG_FILE = "fake_engine.json"
EOS_TOKEN_ID = 2
# A prompt ending in this token makes the first generated token EOS (tests that path).
EOS_TRIGGER_TOKEN_ID = 1
VOCAB_SIZE = 1000
_FIRST_REGULAR_TOKEN = 3


@dataclass(frozen=True)
class FakeEngineSettings:
    num_layers: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0
    context_length: int = 4096
    # Prompt ids up to this are accepted: a real tokenizer's vocabulary (the
    # router tokenizes with it), while generated ids stay below VOCAB_SIZE.
    input_vocab_size: int = VOCAB_SIZE

    @classmethod
    def from_dir(cls, model_dir: str | Path | None) -> FakeEngineSettings:
        if not model_dir:
            return cls()
        data = {"input_vocab_size": _checkpoint_vocab_size(Path(model_dir))}
        path = Path(model_dir) / CONFIG_FILE
        if path.is_file():
            data.update(json.loads(path.read_text()))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _checkpoint_vocab_size(model_dir: Path) -> int:
    config = model_dir / "config.json"
    if not config.is_file():
        return VOCAB_SIZE
    return max(VOCAB_SIZE, int(json.loads(config.read_text()).get("vocab_size", VOCAB_SIZE)))


def next_token(prompt: tuple[int, ...], index: int, seed: int | None) -> int:
    """The completion token at ``index``: a pure function of prompt, position and seed."""
    if index == 0 and prompt and prompt[-1] == EOS_TRIGGER_TOKEN_ID:
        return EOS_TOKEN_ID
    mix = (sum(prompt) * 31 + len(prompt) * 17 + index * 7919 + (seed or 0) * 104729) % 2**31
    return _FIRST_REGULAR_TOKEN + mix % (VOCAB_SIZE - _FIRST_REGULAR_TOKEN)


def expected_tokens(
    request: GenerationRequest, eos_ids: tuple[int, ...] = (EOS_TOKEN_ID,)
) -> list[int]:
    """What ``generate`` emits for ``request`` (tests compare node output against this)."""
    tokens: list[int] = []
    seed = request.sampling.seed if not request.sampling.is_greedy else None
    for index in range(request.max_tokens):
        token = next_token(tuple(request.prompt_tokens), index, seed)
        tokens.append(token)
        if token in eos_ids or token in request.stop_token_ids:
            break
    return tokens


def make_layer(prompt: tuple[int, ...], layer: int, settings: FakeEngineSettings) -> CacheLayer:
    values = np.asarray(prompt, dtype=np.float32) + layer
    shape = (1, settings.kv_heads, len(prompt), settings.head_dim)
    keys = np.broadcast_to(values.reshape(1, 1, -1, 1), shape).copy()
    return CacheLayer("KVCache", keys, -keys, "float32", len(prompt))


def prompt_from_cache(cache: CacheState) -> tuple[int, ...]:
    """Read the prompt back; raises EngineError when layers disagree (a damaged cache)."""
    first = cache.layers[0].keys[0, 0, :, 0]
    for index, layer in enumerate(cache.layers):
        if not (np.all(layer.keys == first.reshape(1, 1, -1, 1) + index)
                and np.array_equal(layer.values, -layer.keys)):
            raise EngineError(f"fake cache layer {index} is inconsistent")
    return tuple(int(v) for v in first)


@dataclass
class _Sequence:
    request: GenerationRequest
    prompt: tuple[int, ...]
    emit: EmitToken
    index: int  # completion index of the next token
    kv_bytes: int


@dataclass
class _Prefill:
    request: GenerationRequest
    on_done: PrefillDone | None = None
    on_layer: LayerReady | None = None
    emit: EmitToken | None = None  # set: a hybrid generate


@dataclass
class _Stats:
    tokens: int = 0
    since_s: float = field(default_factory=time.monotonic)


class FakeEngine:
    def __init__(self, settings: FakeEngineSettings, config: EngineConfig | None = None):
        self.settings = settings
        self.config = config or EngineConfig()
        self.info = ModelInfo(
            model_id="fake",
            fingerprint={
                "architecture": "fake",
                "num_layers": settings.num_layers,
                "kv_heads": settings.kv_heads,
                "head_dim": settings.head_dim,
                "dtype": "float32",
                "cache_classes": ["KVCache"] * settings.num_layers,
            },
            context_length=settings.context_length,
            eos_token_ids=(EOS_TOKEN_ID,),
            vocab_size=settings.input_vocab_size,
        )
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._prefills: list[_Prefill] = []
        self._batch: dict[str, _Sequence] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stats = EngineStats()
        self._speed = _Stats()

    # -- Engine protocol (any thread) ------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._commands.put(("stop", None))
            self._thread.join(timeout=10)
            self._thread = None
        self._cancel_queued()

    def generate(self, request: GenerationRequest, emit: EmitToken) -> None:
        self._submit("prefill", _Prefill(request, emit=emit))

    def prefill(
        self, request: GenerationRequest, on_done: PrefillDone, on_layer: LayerReady | None = None
    ) -> None:
        self._submit("prefill", _Prefill(request, on_done, on_layer))

    def decode(
        self, request: GenerationRequest, first_token: int, cache: CacheState, emit: EmitToken
    ) -> None:
        self._submit("decode", (request, cache, emit))

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def _submit(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        if self._closed:  # a closed engine ends every request at once, never hangs
            self._cancel_queued()

    def _cancel_queued(self) -> None:
        while True:  # drains what close() left behind
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            closed = EngineError("engine closed", code="cancelled")
            if kind == "prefill":
                self._refuse(payload, closed, FINISH_CANCELLED)
            elif kind == "decode":
                payload[2](TokenEvent(payload[0].request_id, 1, None, FINISH_CANCELLED))

    # -- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        while self._handle_commands():  # until "stop"
            if self._prefills:
                self._run_prefill(self._prefills.pop(0))
            self._step()
            self._update_stats()
        for sequence in list(self._batch.values()):
            self._end(sequence, FINISH_CANCELLED)
        for job in self._prefills:
            self._refuse(job, EngineError("engine closed", code="cancelled"), FINISH_CANCELLED)

    def _handle_commands(self) -> bool:
        block = not (self._prefills or self._batch)
        while True:  # drains the queue; blocks only while idle
            try:
                kind, payload = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            self._apply(kind, payload)

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "cancel":
            self._cancel(payload)
        elif kind == "prefill":
            try:
                self._check(payload.request)
            except MlxcelError as exc:
                self._refuse(payload, exc, FINISH_ERROR)
                return
            self._prefills.append(payload)
        elif kind == "decode":
            self._admit(*payload)

    def _check(self, request: GenerationRequest) -> None:
        if not request.prompt_tokens:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if request.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        vocab = self.settings.input_vocab_size
        if min(request.prompt_tokens) < 0 or max(request.prompt_tokens) >= vocab:
            raise InvalidRequestError("prompt token id out of range", param="prompt")
        if len(request.prompt_tokens) >= self.settings.context_length:
            raise ContextLengthError(f"prompt of {len(request.prompt_tokens)} tokens is too long")
        if len(self._batch) >= self.config.max_sequences:
            raise AtCapacityError("fake engine holds max_sequences")

    def _refuse(self, job: _Prefill, exc: MlxcelError, reason: str) -> None:
        if job.on_done is not None:
            job.on_done(exc)
        elif job.emit is not None:
            error = None if reason == FINISH_CANCELLED else exc.message
            job.emit(TokenEvent(job.request.request_id, 0, None, reason, error))

    def _run_prefill(self, job: _Prefill) -> None:
        request, prompt = job.request, tuple(job.request.prompt_tokens)
        per_layer_s = self.settings.prefill_s_per_token * len(prompt) / self.settings.num_layers
        layers = []
        for index in range(self.settings.num_layers):
            if per_layer_s:
                time.sleep(per_layer_s)
            layers.append(make_layer(prompt, index, self.settings))
            if job.on_layer is not None:
                job.on_layer(index, layers[-1])
        first = next_token(prompt, 0, self._seed(request))
        reason = self._finish_reason(request, first, 0)
        cache = CacheState(layers)
        if job.on_done is not None:
            job.on_done(PrefillResult(request, first, cache, reason))
            return
        job.emit(TokenEvent(request.request_id, 0, first, reason))
        if reason is None:
            self._batch[request.request_id] = _Sequence(request, prompt, job.emit, 1, cache.nbytes)

    def _admit(self, request: GenerationRequest, cache: CacheState, emit: EmitToken) -> None:
        try:
            self._check(request)
            self._check_cache(cache, len(request.prompt_tokens))
            prompt = prompt_from_cache(cache)
            if prompt != tuple(request.prompt_tokens):
                raise EngineError("the cache holds another prompt than the request's")
        except MlxcelError as exc:
            emit(TokenEvent(request.request_id, 1, None, FINISH_ERROR, exc.message))
            return
        self._batch[request.request_id] = _Sequence(request, prompt, emit, 1, cache.nbytes)

    def _check_cache(self, cache: CacheState, prompt_tokens: int) -> None:
        settings = self.settings
        want = (1, settings.kv_heads, prompt_tokens, settings.head_dim)
        if len(cache.layers) != settings.num_layers or any(
            layer.keys.shape != want or layer.values.shape != want or layer.offset != prompt_tokens
            for layer in cache.layers
        ):
            raise EngineError("the cache does not fit this model and prompt")

    def _step(self) -> None:
        if not self._batch:
            return
        if self.settings.decode_step_s:
            time.sleep(self.settings.decode_step_s)
        # At zero cost the engine runs ahead of the node in bursts (Python switches
        # threads every few ms); commands such as cancel are still read every step.
        for sequence in list(self._batch.values()):
            request = sequence.request
            token = next_token(sequence.prompt, sequence.index, self._seed(request))
            reason = self._finish_reason(request, token, sequence.index)
            sequence.emit(TokenEvent(request.request_id, sequence.index, token, reason))
            sequence.index += 1
            self._speed.tokens += 1
            if reason is not None:
                del self._batch[request.request_id]

    def _seed(self, request: GenerationRequest) -> int | None:
        return None if request.sampling.is_greedy else request.sampling.seed

    def _finish_reason(self, request: GenerationRequest, token: int, index: int) -> str | None:
        if token in self.info.eos_token_ids or token in request.stop_token_ids:
            return FINISH_STOP
        if index + 1 >= request.max_tokens:
            return FINISH_LENGTH
        return None

    def _cancel(self, request_id: str) -> None:
        for job in [j for j in self._prefills if j.request.request_id == request_id]:
            self._prefills.remove(job)
            self._refuse(job, EngineError("cancelled", code="cancelled"), FINISH_CANCELLED)
        sequence = self._batch.get(request_id)
        if sequence is not None:
            self._end(sequence, FINISH_CANCELLED)

    def _end(self, sequence: _Sequence, reason: str) -> None:
        self._batch.pop(sequence.request.request_id, None)
        sequence.emit(TokenEvent(sequence.request.request_id, sequence.index, None, reason))

    def _update_stats(self) -> None:
        kv_bytes = sum(s.kv_bytes for s in self._batch.values())
        elapsed = max(time.monotonic() - self._speed.since_s, 1e-9)
        budget = self.config.kv_memory_bytes
        self._stats = EngineStats(
            queued=len(self._prefills) + self._commands.qsize(),
            active_sequences=len(self._batch),
            kv_bytes=kv_bytes,
            free_kv_fraction=max(0.0, 1.0 - kv_bytes / budget) if budget else 1.0,
            tokens_per_s=self._speed.tokens / elapsed,
        )
        if elapsed > 5.0:
            self._speed = _Stats()


def make_fake_engine(model_path: str | None, config: EngineConfig) -> FakeEngine:
    """The ``fake`` engine factory (knobs from ``fake_engine.json`` in ``model_path``)."""
    return FakeEngine(FakeEngineSettings.from_dir(model_path), config)
