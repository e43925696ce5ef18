"""A zero-cost, deterministic Engine (registered as engine ``"fake"``).

It implements the whole ``Engine`` protocol — generate, prefill (with
``on_layer``), decode of a handed-off cache, cancel, stats — on its own
thread, like the MLX engine, so node tests, front tests and the
router-overhead benchmark run without MLX.

By default its tokens and caches are those of ``fake_model`` (a pure function
of prompt, position and seed; knobs from ``fake_engine.json``).
``FakeEngine.scripted(script)`` replies with ``script(request)`` instead, for
tests that want exact text. Either way it records what it was asked
(``requests``) and what it cancelled (``cancelled``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
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
from mlxcel_plugin.testing.fake_logprobs import first_logprobs, token_logprobs
from mlxcel_plugin.testing.fake_model import (
    CONFIG_FILE,
    EOS_TOKEN_ID,
    EOS_TRIGGER_TOKEN_ID,
    VOCAB_SIZE,
    FakeEngineSettings,
    FakePrefixStore,
    expected_tokens,
    make_layer,
    next_token,
    prompt_from_cache,
)

__all__ = [
    "CONFIG_FILE",
    "EOS_TOKEN_ID",
    "EOS_TRIGGER_TOKEN_ID",
    "VOCAB_SIZE",
    "FakeEngine",
    "FakeEngineSettings",
    "Script",
    "expected_tokens",
    "make_layer",
    "next_token",
    "prompt_from_cache",
]

# A scripted engine's reply: its tokens in order; it stops after the last one.
Script = Callable[[GenerationRequest], Sequence[int]]
# SmolLM2's vocabulary: front tests tokenize prompts with the tiny checkpoint's tokenizer.
SCRIPTED_VOCAB_SIZE = 49152
SCRIPTED_CONTEXT_LENGTH = 2048


@dataclass
class _Sequence:
    request: GenerationRequest
    prompt: tuple[int, ...]
    emit: EmitToken
    index: int  # completion index of the next token
    kv_bytes: int
    script: list[int] | None = None  # a scripted engine's reply


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
    def __init__(
        self,
        settings: FakeEngineSettings | None = None,
        config: EngineConfig | None = None,
        *,
        script: Script | None = None,
        eos_token_ids: Sequence[int] = (EOS_TOKEN_ID,),
    ):
        self.settings = settings = settings or FakeEngineSettings()
        self.config = config or EngineConfig()
        self.script = script
        self.requests: list[GenerationRequest] = []  # as submitted, in order
        self.cancelled: list[str] = []  # ids a cancel found queued or running
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
            eos_token_ids=tuple(eos_token_ids),
            vocab_size=settings.input_vocab_size,
        )
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._prefills: list[_Prefill] = []
        self._batch: dict[str, _Sequence] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stats = EngineStats()
        self._speed = _Stats()
        # Delta handoffs: prompts it decoded or generated stand for their cached K/V.
        self.prefixes = FakePrefixStore(enabled=self.config.prefix_cache.max_bytes > 0)
        self.reserve_prefix, self.release_prefix = self.prefixes.pin, self.prefixes.unpin

    @classmethod
    def scripted(
        cls,
        script: Script,
        *,
        eos_token_ids: Sequence[int] = (EOS_TOKEN_ID,),
        context_length: int = SCRIPTED_CONTEXT_LENGTH,
        token_delay_s: float = 0.0,
    ) -> FakeEngine:
        """An engine that replies ``script(request)``, one token per step of ``token_delay_s``."""
        settings = FakeEngineSettings(decode_step_s=token_delay_s, context_length=context_length,
                                      input_vocab_size=SCRIPTED_VOCAB_SIZE)
        return cls(settings, script=script, eos_token_ids=eos_token_ids)

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
        self.requests.append(request)
        self._submit("prefill", _Prefill(request, emit=emit))

    def prefill(
        self, request: GenerationRequest, on_done: PrefillDone, on_layer: LayerReady | None = None
    ) -> None:
        self.requests.append(request)
        self._submit("prefill", _Prefill(request, on_done, on_layer))

    def decode(
        self, request: GenerationRequest, first_token: int, cache: CacheState, emit: EmitToken
    ) -> None:
        self.requests.append(request)
        self._submit("decode", (request, cache, emit))

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def live_ids(self) -> list[str]:
        """Requests queued for prefill or decoding now (read from any thread)."""
        return [job.request.request_id for job in list(self._prefills)] + list(self._batch)

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
        script = self._script(request)
        first, reason = self._token(request, prompt, script, 0)
        cache, logprobs = CacheState(layers), first_logprobs(request, first, self.info.vocab_size)
        if job.on_done is not None:
            job.on_done(PrefillResult(request, first, cache, reason, 0, *logprobs))
            return
        job.emit(TokenEvent(request.request_id, 0, first, reason, None, 0, *logprobs))
        self.prefixes.keep(prompt)
        if reason is None:
            self._batch[request.request_id] = _Sequence(
                request, prompt, job.emit, 1, cache.nbytes, script)

    def _admit(self, request: GenerationRequest, cache: CacheState, emit: EmitToken) -> None:
        try:
            self._check(request)
            cache = self.prefixes.splice(request.request_id, cache, self.settings)
            self._check_cache(cache, len(request.prompt_tokens))
            prompt = prompt_from_cache(cache)
            if prompt != tuple(request.prompt_tokens):
                raise EngineError("the cache holds another prompt than the request's")
        except MlxcelError as exc:
            emit(TokenEvent(request.request_id, 1, None, FINISH_ERROR, exc.message))
            return
        self.prefixes.keep(prompt)
        self._batch[request.request_id] = _Sequence(
            request, prompt, emit, 1, cache.nbytes, self._script(request))

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
            token, reason = self._token(request, sequence.prompt, sequence.script, sequence.index)
            logprobs = token_logprobs(request, sequence.index, token, self.info.vocab_size)
            sequence.emit(TokenEvent(request.request_id, sequence.index, token, reason,
                                     logprobs=logprobs))
            sequence.index += 1
            self._speed.tokens += 1
            if reason is not None:
                del self._batch[request.request_id]

    def _script(self, request: GenerationRequest) -> list[int] | None:
        return None if self.script is None else list(self.script(request))

    def _token(self, request: GenerationRequest, prompt: tuple[int, ...],
               script: list[int] | None, index: int) -> tuple[int | None, str | None]:
        """The token at completion ``index`` and the finish reason it brings, if any."""
        if script is None:
            seed = None if request.sampling.is_greedy else request.sampling.seed
            token, last = next_token(prompt, index, seed), False
        elif index < len(script):
            token, last = script[index], index == len(script) - 1
        else:  # an empty script: the reply ends at once
            return None, FINISH_STOP
        return token, self._finish_reason(request, token, index, last)

    def _finish_reason(self, request: GenerationRequest, token: int, index: int,
                       last: bool) -> str | None:
        if last or token in self.info.eos_token_ids or token in request.stop_token_ids:
            return FINISH_STOP
        if index + 1 >= request.max_tokens:
            return FINISH_LENGTH
        return None

    def _cancel(self, request_id: str) -> None:
        self.prefixes.unpin(request_id)
        queued = [j for j in self._prefills if j.request.request_id == request_id]
        sequence = self._batch.get(request_id)
        if queued or sequence is not None:
            self.cancelled.append(request_id)
        for job in queued:
            self._prefills.remove(job)
            self._refuse(job, EngineError("cancelled", code="cancelled"), FINISH_CANCELLED)
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
