"""``MlxEngine``: the ``Engine`` contract for mlx-lm models.

One engine thread owns the model and is fed by a queue. Each loop iteration
handles queued commands, runs at most one prefill, admits waiting sequences
into the running decode batch (continuous batching), and decodes one token for
every sequence in the batch. Callbacks run on the engine thread.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engines import cache_layout, kv_arrival, kv_convert
from engines.decode_batch import Sequence
from engines.engine_commands import (
    Cancel,
    Decode,
    Generate,
    Prefill,
    Stop,
    cancel_command,
    cancel_queued,
    deliver,
    finish_command,
)
from engines.engine_memory import EngineMemory, model_bytes
from engines.grammar import request_sampler
from engines.handoff_arrivals import HandoffArrivals
from engines.kv_quant import KVQuantizer
from engines.model_loader import load_mlx_model, model_info
from engines.prefill import Prefilled, prefill_request, prepare_prefills
from engines.prefix.cache import PrefixCache
from engines.prefix.splice import handoff_caches
from engines.request_rules import SpeedMeter, check_request, finish_reason
from engines.sliced_join import sliced_joins
from engines.speculative.batch import SpeculativeBatch
from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_ERROR,
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
    RowsReady,
    TokenEvent,
)
from mlxcel_plugin.errors import AtCapacityError, EngineError, MlxcelError
from mlxcel_plugin.libc import name_os_thread

log = logging.getLogger(__name__)


class MlxEngine:
    """An mlx-lm model served by one thread: hybrid, prefill and decode roles."""
    streams_prefill_rows = True  # engine_api.prefill_rows: each cell's K/V after its forward

    def __init__(self, model: nn.Module, info: ModelInfo, config: EngineConfig):
        self.model = model
        self._kv_quant = KVQuantizer(config)  # [engine] kv_bits: quantized once prefilled
        self.info = self._kv_quant.described(info, model)
        self._memory = EngineMemory(model_bytes(model), config)  # KV budget sized from weights
        self.config, self.model_bytes = self._memory.config, self._memory.model_bytes
        self._commands: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready, self._closed = threading.Event(), False
        # Engine-thread state.
        self._prefills: deque[Generate | Prefill] = deque()
        self._waiting: deque[tuple[Sequence, list[Any]]] = deque()
        self._batch, self._speed = SpeculativeBatch(model, config.speculative, info), SpeedMeter()
        self._arrivals = HandoffArrivals(self._fit_prefix_cache, sliced_joins(model, self._batch))
        self.kv_buffers = kv_convert.ReceiveBuffers()  # received K/V land in MLX (engine_api)
        self._engine_stream: mx.Stream | None = None  # the engine thread's, set as it starts
        self._prefix = PrefixCache.for_model(model, self.config)
        self._nesting = cache_layout.nesting(cache_layout.make_prompt_cache(model))  # CacheLists
        # Before the first request too: a router trusts its prefix index for this node from it.
        self._stats = EngineStats(free_kv_fraction=1.0, prefix_cache=self._prefix.stats())
        # Delta handoffs (engine_api.Engine): pins on the prefix cache, taken from any thread.
        self.reserve_prefix, self.release_prefix = self._prefix.pin, self._prefix.unpin

    @classmethod
    def from_path(cls, model_path: str, config: EngineConfig) -> MlxEngine:
        model, model_config = load_mlx_model(model_path)
        return cls(model, model_info(model_path, model, model_config), config)

    # -- public API (any thread) ---------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._memory.apply()  # freed buffers kept warm: a few handoffs, not the KV budget
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._thread.start()
        # An engine left open at interpreter exit must still release its MLX stream.
        atexit.register(self.close)
        # Serve only once warm, so health checks and first requests see steady latency.
        self._ready.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._commands.put(Stop())
        if self._thread is not None:
            self._thread.join()
        cancel_queued(self._commands)

    def generate(self, request: GenerationRequest, emit: EmitToken) -> None:
        self._submit(Generate(request, emit))

    def prefill(self, request: GenerationRequest, on_done: PrefillDone,
                on_layer: LayerReady | None = None, on_rows: RowsReady | None = None) -> None:
        self._submit(Prefill(request, on_done, on_layer, on_rows))

    def decode(
        self, request: GenerationRequest, first_token: int, cache: CacheState, emit: EmitToken
    ) -> None:
        self._submit(Decode(request, first_token, cache, emit))

    def adopt_layer(self, layer: CacheLayer) -> CacheLayer:
        """A received layer as MLX arrays, on the caller's thread (engine_api.Engine)."""
        return kv_convert.adopt_layer(layer, self._engine_stream)

    def cancel(self, request_id: str) -> None:
        self._commands.put(Cancel(request_id))

    def stats(self) -> EngineStats:
        snapshot = self._stats  # the engine thread's, plus commands not yet taken
        return dataclasses.replace(snapshot, queued=snapshot.queued + self._commands.qsize())

    def _submit(self, command: Any) -> None:
        if self._closed:
            cancel_command(command)
            return
        self._commands.put(command)

    # -- engine thread: main loop --------------------------------------------------------

    def _run(self) -> None:
        name_os_thread()
        self._engine_stream = mx.default_stream(mx.cpu)  # adopted layers are evaluated here
        try:
            self._serve()
        finally:
            # MLX gives each thread its own stream (and worker); leaving it behind
            # aborts the process at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            prepare_prefills(self.model, self._prefix, self.config, self.info)
            self._update_stats()  # the grid's exact_min_rows, before any request
        finally:
            self._ready.set()
        while self._handle_commands():
            self._prefill_next()
            self._arrivals.admit(self._waiting, self._batch, self.config.max_batch_size)
            self._decode_step()
            self._arrivals.first_forwards(self._waiting, self._batch)
            self._arrivals.after_step(self._batch, self._waiting)
            self.kv_buffers.prefault(decoding=bool(len(self._batch)))  # engines/unfilled.py
            self._update_stats()
        self._cancel_everything()

    def _has_work(self) -> bool:
        return bool(self._prefills or self._waiting or self._arrivals or len(self._batch))

    def _handle_commands(self) -> bool:
        """Apply queued commands (blocking while idle); False once asked to stop."""
        block = not self._has_work()
        while True:
            try:
                command = self._memory.idle.next_command(self._commands, block)  # frees idle
            except queue.Empty:
                return True
            block = False
            if isinstance(command, Stop):
                return False
            self._apply(command)

    def _apply(self, command: Any) -> None:
        if isinstance(command, Cancel):
            self._cancel(command.request_id)
            return
        try:
            check_request(command.request, self.info)
            self._check_capacity()
            if isinstance(command, Decode):
                self._accept_handoff(command)
            else:
                self._prefills.append(command)
        except MlxcelError as exc:
            finish_command(command, FINISH_ERROR, exc)
        except Exception as exc:  # a malformed request must not stop the engine thread
            log.exception("request %s refused", command.request.request_id)
            finish_command(command, FINISH_ERROR, EngineError(str(exc)))

    # -- admission -----------------------------------------------------------------------

    def _held_sequences(self) -> int:
        generating = sum(isinstance(job, Generate) for job in self._prefills)
        return len(self._batch) + len(self._waiting) + generating

    def _kv_bytes(self) -> int:
        waiting = sum(c.nbytes for _, caches in self._waiting for c in caches)
        return self._batch.nbytes + int(waiting) + self._prefix.nbytes

    def _kv_limit_bytes(self) -> float:
        return self.config.memory_threshold * self.config.kv_memory_bytes

    def _fit_prefix_cache(self) -> None:
        """Evict cached prefixes so that all KV held stays under the budget's threshold."""
        others = self._kv_bytes() - self._prefix.nbytes
        self._prefix.evict_to(int(self._kv_limit_bytes()) - others)

    def _check_capacity(self) -> None:
        if self._held_sequences() >= self.config.max_sequences:
            raise AtCapacityError(f"engine holds max_sequences={self.config.max_sequences}")
        limit = self._kv_limit_bytes()
        if self._kv_bytes() >= limit:
            self._fit_prefix_cache()  # cached prefixes go before any request is refused
        if self._kv_bytes() >= limit:
            raise AtCapacityError(f"KV memory above {self.config.memory_threshold:.0%} of budget")

    def _accept_handoff(self, command: Decode) -> None:
        request, first = command.request, command.first_token
        prompt = request.prompt_tokens
        pin = self._prefix.take_pin(request.request_id)  # a delta handoff's prefix
        cache = kv_arrival.checked(command.cache, self.info.fingerprint, len(prompt), pin)
        sampler = request_sampler(request, self.info, (first,))  # a grammar replays ``first``
        sequence = Sequence(request, command.emit, sampler, first, 1, [first])
        # The first token was emitted by the prefill node; it may already end the request.
        reason = finish_reason(request, self.info, first, 1)
        if reason is not None:
            deliver(command.emit, TokenEvent(request.request_id, 1, None, reason))
            return
        caches = self._kv_quant.caches(handoff_caches(cache, pin, self._nesting))
        # A prefill node computed these chunks: the next turn may prefill here (local).
        self._arrivals.store_later(request.request_id, self._prefix, prompt, caches)
        self._waiting.append((sequence, caches))
        self._arrivals.adopted(decoding=bool(len(self._batch)))  # it joins at the next step

    # -- prefill -------------------------------------------------------------------------

    def _prefill_next(self) -> None:
        if not self._prefills:
            return
        job = self._prefills.popleft()
        self._arrivals.flush()  # received prompts stored first: this prefill may reuse them
        if isinstance(job, Generate):
            self._run_generate(job)
        else:
            self._run_prefill_only(job)
        self._prefix.store_pending(adopt=not isinstance(job, Generate))  # prefix/cache.py
        self._fit_prefix_cache()

    def _prefill_request(self, request: GenerationRequest, on_layer: Any = None,
                         on_rows: Any = None) -> Prefilled:
        return prefill_request(self.model, request, self._prefix, self.config, self.info,
                               on_layer, on_rows)

    def _run_generate(self, job: Generate) -> None:
        request = job.request
        try:
            done = self._prefill_request(request)
        except Exception as exc:  # one request's failure must not stop the engine
            log.exception("prefill of %s failed", request.request_id)
            finish_command(job, FINISH_ERROR, exc)
            return
        token = done.token
        sequence = Sequence(request, job.emit, done.sampler, token, 1, [token])
        reason = finish_reason(request, self.info, token, 1)
        first = TokenEvent(request.request_id, 0, token, reason, None, done.cached_tokens,
                           done.logprobs, done.prompt_logprobs)
        if deliver(job.emit, first) and reason is None:
            self._waiting.append((sequence, self._kv_quant.caches(done.caches)))

    def _run_prefill_only(self, job: Prefill) -> None:
        request = job.request
        layers: list[CacheLayer] = []

        def layer_ready(_: int, cache: Any) -> None:  # a CacheList is several handoff layers
            for leaf in cache_layout.leaves([self._kv_quant.cache(cache)]):
                layers.append(kv_convert.to_cache_layer(leaf, len(request.prompt_tokens)))
                if job.on_layer is not None:
                    job.on_layer(len(layers) - 1, layers[-1])

        rows = job.on_rows if self.streams_prefill_rows and not self._kv_quant.enabled else None
        try:
            done = self._prefill_request(request, layer_ready,
                                         rows and kv_convert.cells_to_rows(rows))
        except Exception as exc:  # one request's failure must not stop the engine
            log.warning("prefill of %s failed: %s", request.request_id, exc)
            deliver(job.on_done, exc)
            return
        reason = finish_reason(request, self.info, done.token, 1)
        result = PrefillResult(request, done.token, CacheState(layers), reason, done.cached_tokens,
                               done.logprobs, done.prompt_logprobs)
        deliver(job.on_done, result)

    # -- decode --------------------------------------------------------------------------

    def _decode_step(self) -> None:
        if not len(self._batch):
            return
        started = time.perf_counter()
        try:
            rows = self._batch.step_rows()  # engines/speculative/: 1 + k rows a sequence
            keep = self._batch.advance(rows, self._advance)  # each accepted token: an event
        except Exception as exc:  # a failed step fails the batch's requests, not the engine
            log.exception("decode step failed")
            self._fail_batch(exc)
            return
        if self._prefix.reuse_generated and len(keep) < len(rows):
            self._store_finished(set(range(len(rows))) - set(keep))
        self._batch.keep(keep)
        self._speed.record(self._batch.emitted, time.perf_counter() - started)

    def _store_finished(self, indices: set[int]) -> None:
        """``reuse_generated``: keep what finished sequences hold, their replies included."""
        sequences = self._batch.sequences
        for i in sorted(indices):
            seq = sequences[i]
            held = (*seq.request.prompt_tokens, *seq.generated[:-1])  # the last was never fed
            self._prefix.store_finished(held, self._batch.sequence_caches(i))
        self._fit_prefix_cache()

    def _advance(self, sequence: Sequence, logits: np.ndarray) -> bool:
        """Sample, emit; True while the sequence goes on."""
        token, logprobs = sequence.take_next(logits)
        reason = finish_reason(sequence.request, self.info, token, sequence.num_generated)
        if reason is not None:  # its next turn may look the prompt up once this is out
            self._arrivals.store_now(sequence.request_id)
        event = TokenEvent(sequence.request_id, sequence.num_generated - 1, token, reason,
                           logprobs=logprobs)
        return deliver(sequence.emit, event) and reason is None

    def _fail_batch(self, exc: Exception) -> None:
        for seq in self._batch.sequences:
            event = TokenEvent(seq.request_id, seq.num_generated, None, FINISH_ERROR, str(exc))
            deliver(seq.emit, event)
        self._batch.keep([])

    # -- cancel / close ------------------------------------------------------------------

    def _cancel(self, request_id: str) -> None:
        self._prefix.unpin(request_id)
        for job in [j for j in self._prefills if j.request.request_id == request_id]:
            self._prefills.remove(job)
            cancel_command(job)
        for item in [w for w in self._waiting if w[0].request_id == request_id]:
            self._waiting.remove(item)
            self._emit_cancelled(item[0])
        for seq in self._batch.remove({request_id}):
            self._emit_cancelled(seq)
        self._update_stats()

    def _emit_cancelled(self, seq: Sequence) -> None:
        deliver(seq.emit, TokenEvent(seq.request_id, seq.num_generated, None, FINISH_CANCELLED))

    def _cancel_everything(self) -> None:
        while self._prefills:
            cancel_command(self._prefills.popleft())
        while self._waiting:
            self._emit_cancelled(self._waiting.popleft()[0])
        for seq in self._batch.remove({s.request_id for s in self._batch.sequences}):
            self._emit_cancelled(seq)
        self._update_stats()

    # -- stats and warmup ----------------------------------------------------------------

    def _update_stats(self) -> None:
        kv_bytes = self._kv_bytes()
        free = 1.0 - kv_bytes / self.config.kv_memory_bytes if self.config.kv_memory_bytes else 1.0
        self._stats = EngineStats(
            queued=len(self._prefills) + len(self._waiting),
            active_sequences=len(self._batch), kv_bytes=kv_bytes,
            free_kv_fraction=max(0.0, free),
            tokens_per_s=self._speed.tokens_per_s,
            prefix_cache=self._prefix.stats(), speculative=self._batch.stats,
        )
