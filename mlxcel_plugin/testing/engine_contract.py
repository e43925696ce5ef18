"""The contract every engine honours; run it on yours.

An engine plugin registers ``factory(model_path, EngineConfig) -> Engine``
(see ``mlxcel_plugin.engine_api``). Subclass ``EngineContract`` in a test
module and provide an ``engine_factory`` fixture: a zero-argument callable
that returns a new, not yet started engine. The suite starts and closes every
engine it makes (decode-after-prefill uses a second one, like a real cluster)::

    import pytest
    from mlxcel_plugin.engine_api import EngineConfig
    from mlxcel_plugin.testing.engine_contract import EngineContract

    class TestMyEngine(EngineContract):
        @pytest.fixture
        def engine_factory(self):
            return lambda: make_my_engine("/path/to/checkpoint", EngineConfig(warmup=False))

The rules, each a test below: every request ends with exactly one terminal
event, after tokens indexed 0, 1, 2, ... (1, 2, ... after a handoff);
``max_tokens`` and stop ids are honoured; greedy and seeded requests are
reproducible, alone or batched; ``cancel`` ends a live request with
``cancelled`` and frees its memory; ``close`` cancels what is pending;
``prefill`` calls ``on_layer`` once per layer and returns a ``PrefillResult``
whose cache matches ``info.fingerprint`` and survives the KV wire format;
decoding that cache (on another engine, received into its ``kv_buffers`` and
``adopt_layer`` where it has them) continues the single-node stream token for
token; ``kv_buffers``, where offered, are writable, separate engine memory;
a bad request fails alone; ``stats`` stay in range and fall back to idle;
delta handoffs, where the engine offers them, hold (``prefix_contract``).
Prompts are drawn from ``info.vocab_size``, so any model works; greedy parity
needs a deterministic engine, which every engine must be. The helpers the tests
use (``EventLog``, ``make_request``, ``check_stream``, ...) are in
``engine_harness`` for your own tests (still importable from here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest

from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    CacheState,
    Engine,
    GenerationRequest,
    ModelInfo,
    PrefillResult,
    SamplingParams,
    kv_buffer_maker,
)
from mlxcel_plugin.errors import MlxcelError
from mlxcel_plugin.kv_serde import ModelFingerprint
from mlxcel_plugin.testing.caches import assert_caches_equal
from mlxcel_plugin.testing.engine_harness import (
    FIRST_TOKEN_ID,
    POLL_S,
    PROMPT_TOKENS,
    SEEDED,
    TERMINAL_REASONS,
    WAIT_S,
    EngineFactory,
    EventLog,
    PrefillOutcome,
    busy,
    check_cache_matches,
    check_layer_tensor,
    check_natural_end,
    check_stats,
    check_stream,
    generate,
    long_request,
    make_prompt,
    make_request,
    prefill,
    through_the_wire,
    wait_idle,
    wait_until,
)
from mlxcel_plugin.testing.prefix_contract import DeltaHandoffContract

# Re-exported: the helpers lived here before ``engine_harness``; plugin tests import them.
__all__ = [
    "FIRST_TOKEN_ID",
    "POLL_S",
    "PROMPT_TOKENS",
    "SEEDED",
    "TERMINAL_REASONS",
    "WAIT_S",
    "EngineContract",
    "EngineFactory",
    "EventLog",
    "PrefillOutcome",
    "busy",
    "check_cache_matches",
    "check_layer_tensor",
    "check_natural_end",
    "check_stats",
    "check_stream",
    "generate",
    "long_request",
    "make_prompt",
    "make_request",
    "prefill",
    "through_the_wire",
    "wait_idle",
    "wait_until",
]


# --- the contract ------------------------------------------------------------------


class EngineContract(DeltaHandoffContract):
    @pytest.fixture
    def engine_factory(self) -> EngineFactory:
        raise NotImplementedError("provide an `engine_factory` fixture")

    @pytest.fixture
    def started(self, engine_factory: EngineFactory) -> Iterator[Callable[[], Engine]]:
        """``started()`` makes and starts an engine; every one is closed after the test."""
        engines: list[Engine] = []

        def make() -> Engine:
            engine = engine_factory()
            engines.append(engine)
            engine.start()
            return engine

        yield make
        for engine in engines:
            engine.close()

    @pytest.fixture
    def engine(self, started: Callable[[], Engine]) -> Engine:
        return started()

    # info ---------------------------------------------------------------------------

    def test_info_is_well_formed(self, engine):
        info = engine.info
        assert isinstance(info, ModelInfo)
        assert isinstance(info.model_id, str) and info.model_id
        assert isinstance(info.context_length, int) and info.context_length > PROMPT_TOKENS + 8
        assert all(isinstance(t, int) and t >= 0 for t in info.eos_token_ids)
        assert isinstance(info.vocab_size, int) and info.vocab_size >= 0
        # The decode side parses the same dict; a handoff needs supported cache kinds.
        ModelFingerprint.from_dict(info.fingerprint).check_supported()

    # generate -----------------------------------------------------------------------

    @pytest.mark.parametrize("max_tokens", [1, 2, 9])
    def test_generate_indexes_tokens_and_ends_once(self, engine, max_tokens):
        request = make_request(engine.info, f"gen-{max_tokens}", max_tokens)
        log = generate(engine, request)
        check_stream(log, 0, max_tokens)
        check_natural_end(log, engine.info, request)
        wait_idle(engine)
        check_stream(log, 0, max_tokens)  # again: nothing may follow the terminal event

    def test_stop_token_ids_end_the_request(self, engine):
        baseline = generate(engine, make_request(engine.info, "base", 6)).tokens
        stop_id = baseline[min(3, len(baseline) - 1)]
        request = make_request(engine.info, "stopped", 6, stop_token_ids=(stop_id,))
        log = generate(engine, request)
        check_stream(log, 0, 6)
        assert log.tokens == baseline[: baseline.index(stop_id) + 1]
        assert log.terminal.finish_reason == FINISH_STOP

    @pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
    def test_same_request_same_tokens(self, engine, sampling):
        request = make_request(engine.info, "again", 12, sampling=sampling)
        assert generate(engine, request).tokens == generate(engine, request).tokens

    def test_concurrent_requests_match_running_alone(self, engine):
        requests = [make_request(engine.info, f"mix-{n}", 10, prompt_tokens=n) for n in (5, 37, 60)]
        alone = [generate(engine, request).tokens for request in requests]
        logs = [EventLog() for _ in requests]
        for request, log in zip(requests, logs, strict=True):
            engine.generate(request, log)
        for request, log in zip(requests, logs, strict=True):
            check_stream(log.wait(), 0, request.max_tokens)
            assert all(event.request_id == request.request_id for event in log.events)
        assert [log.tokens for log in logs] == alone

    # cancel and close ---------------------------------------------------------------

    def test_cancel_emits_cancelled_and_frees(self, engine):
        request = long_request(engine.info, "cancel-me")
        log = EventLog()
        engine.generate(request, log)
        log.wait_for_events(3)
        engine.cancel(request.request_id)
        log.wait()
        check_stream(log, 0, request.max_tokens)
        assert log.terminal.finish_reason == FINISH_CANCELLED
        assert log.terminal.token_id is None, "a cancel carries no token"
        wait_idle(engine)
        check_stream(log, 0, request.max_tokens)  # again: nothing may follow the cancel

    def test_cancel_from_inside_emit(self, engine):
        # Callbacks run on the engine thread; cancel must not deadlock there.
        request = long_request(engine.info, "cancel-inside")
        log = EventLog(lambda e: engine.cancel(e.request_id) if e.index == 1 else None)
        engine.generate(request, log)
        check_stream(log.wait(), 0, request.max_tokens)
        assert log.terminal.finish_reason == FINISH_CANCELLED
        wait_idle(engine)

    def test_cancel_racing_the_request_still_ends_it_once(self, engine):
        request = make_request(engine.info, "race", 4)
        log = EventLog()
        engine.generate(request, log)
        engine.cancel(request.request_id)
        check_stream(log.wait(), 0, request.max_tokens)
        wait_idle(engine)

    def test_cancel_of_an_unknown_request_is_harmless(self, engine):
        engine.cancel("never-submitted")
        request = make_request(engine.info, "after-unknown-cancel", 3)
        check_stream(generate(engine, request), 0, 3)

    def test_cancel_a_decode_after_handoff(self, started):
        prefill_engine, decode_engine = started(), started()
        request = long_request(prefill_engine.info, "cancel-decode")
        result, _ = prefill(prefill_engine, request)
        log = EventLog()
        decode_engine.decode(request, result.first_token, result.cache, log)
        log.wait_for_events(2)
        decode_engine.cancel(request.request_id)
        check_stream(log.wait(), 1, request.max_tokens)
        assert log.terminal.finish_reason == FINISH_CANCELLED
        wait_idle(decode_engine)

    def test_close_cancels_pending_requests(self, engine_factory):
        engine = engine_factory()
        engine.start()
        request = long_request(engine.info, "pending")
        log = EventLog()
        engine.generate(request, log)
        log.wait_for_events(2)
        engine.close()
        check_stream(log.wait(), 0, request.max_tokens)
        assert log.terminal.finish_reason == FINISH_CANCELLED
        late = EventLog()
        engine.generate(make_request(engine.info, "after-close", 3), late)
        # A request to a closed engine must end at once, never hang.
        assert late.wait(10.0).terminal.finish_reason in (FINISH_CANCELLED, FINISH_ERROR)
        assert late.terminal.token_id is None and len(late.events) == 1

    # prefill and decode -------------------------------------------------------------

    @pytest.mark.parametrize("prompt_tokens", [1, PROMPT_TOKENS])
    def test_prefill_result_matches_the_fingerprint(self, engine, prompt_tokens):
        request = make_request(engine.info, "pre", 8, prompt_tokens=prompt_tokens)
        result, outcome = prefill(engine, request)
        assert isinstance(result, PrefillResult) and result.request == request
        assert isinstance(result.first_token, int) and result.first_token >= 0
        assert result.finish_reason in (None, FINISH_STOP)
        check_cache_matches(result.cache, engine.info.fingerprint, len(request.prompt_tokens))
        assert outcome.done_calls == 1
        # on_layer reports each layer once, with the K/V the result carries.
        assert sorted(i for i, _ in outcome.layers) == list(range(len(result.cache.layers)))
        for index, layer in outcome.layers:
            assert_caches_equal(CacheState([layer]), CacheState([result.cache.layers[index]]))
        wait_idle(engine)

    def test_prefill_cache_survives_the_wire(self, engine):
        request = make_request(engine.info, "wire", 8)
        result, _ = prefill(engine, request)
        assert_caches_equal(through_the_wire(result, engine.info), result.cache)

    def test_kv_buffers_are_writable_engine_memory(self, engine):
        make_buffers = kv_buffer_maker(engine)
        if make_buffers is None:
            pytest.skip("engine offers no kv_buffers (received K/V stays in numpy buffers)")
        shape, dtype = (1, 2, 5, 8), np.dtype(np.float32)
        buffers = make_buffers(shape, dtype, 2)
        assert len(buffers) == 2 and buffers[0] is not buffers[1]
        for buffer in buffers:
            assert buffer.shape == shape and buffer.dtype == dtype
            assert buffer.flags.c_contiguous and buffer.flags.writeable
        buffers[0][...] = 1.5
        assert not np.shares_memory(buffers[0], buffers[1])

    def test_prefill_with_max_tokens_1_ends_there(self, engine):
        result, _ = prefill(engine, make_request(engine.info, "one", 1))
        assert result.finish_reason in (FINISH_LENGTH, FINISH_STOP)

    @pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
    @pytest.mark.parametrize("prompt_tokens", [1, PROMPT_TOKENS])
    def test_decode_on_another_engine_continues_the_stream(self, started, sampling, prompt_tokens):
        prefill_engine, decode_engine = started(), started()
        info = prefill_engine.info
        request = make_request(info, "split", 10, prompt_tokens=prompt_tokens, sampling=sampling)
        single_node = generate(prefill_engine, request)
        result, _ = prefill(prefill_engine, request)
        log = EventLog()
        cache = through_the_wire(result, info, receiver=decode_engine)
        decode_engine.decode(request, result.first_token, cache, log)
        check_stream(log.wait(), 1, request.max_tokens)
        check_natural_end(log, info, request)
        assert [result.first_token, *log.tokens] == single_node.tokens
        wait_idle(decode_engine)

    # failures -----------------------------------------------------------------------

    def bad_requests(self, info: ModelInfo) -> dict[str, GenerationRequest]:
        good = make_request(info, "bad", 4)
        fills_context = (FIRST_TOKEN_ID,) * info.context_length
        bad = {
            "empty-prompt": replace(good, prompt_tokens=()),
            "zero-max-tokens": replace(good, max_tokens=0),
            "prompt-fills-context": replace(good, prompt_tokens=fills_context),
        }
        if info.vocab_size:
            bad["token-out-of-vocab"] = replace(good, prompt_tokens=(info.vocab_size,))
        return bad

    def test_a_bad_request_fails_alone(self, engine):
        good = make_request(engine.info, "good", 8)
        expected = generate(engine, good).tokens
        for kind, bad in self.bad_requests(engine.info).items():
            good_log, bad_log = EventLog(), EventLog()
            engine.generate(good, good_log)
            engine.generate(bad, bad_log)
            bad_log.wait()
            assert len(bad_log.events) == 1, f"{kind}: {bad_log.events}"
            end = bad_log.terminal
            assert (end.index, end.token_id, end.finish_reason) == (0, None, FINISH_ERROR), kind
            assert isinstance(end.error, str) and end.error, f"{kind}: say what was wrong"
            assert good_log.wait().tokens == expected, f"{kind} disturbed another request"
        wait_idle(engine)

    def test_a_bad_prefill_reports_an_exception(self, engine):
        for kind, bad in self.bad_requests(engine.info).items():
            outcome = PrefillOutcome()
            engine.prefill(bad, outcome.on_done, outcome.on_layer)
            result = outcome.wait()
            assert isinstance(result, MlxcelError), f"{kind}: on_done got {type(result).__name__}"
            assert outcome.done_calls == 1
        check_stream(generate(engine, make_request(engine.info, "still-fine", 3)), 0, 3)

    def test_a_cache_that_does_not_fit_fails_only_its_decode(self, started):
        prefill_engine, decode_engine = started(), started()
        request = make_request(prefill_engine.info, "misfit", 6)
        result, _ = prefill(prefill_engine, request)
        short = CacheState(result.cache.layers[:-1])
        bad_log = EventLog()
        decode_engine.decode(request, result.first_token, short, bad_log)
        bad_log.wait()
        assert len(bad_log.events) == 1, f"one error event, got {bad_log.events[:3]}"
        end = bad_log.terminal
        assert (end.index, end.token_id, end.finish_reason) == (1, None, FINISH_ERROR), end
        good_log = EventLog()
        decode_engine.decode(request, result.first_token, result.cache, good_log)
        check_stream(good_log.wait(), 1, request.max_tokens)
        check_natural_end(good_log, prefill_engine.info, request)

    # stats --------------------------------------------------------------------------

    def test_stats_are_sane_and_return_to_idle(self, engine):
        check_stats(wait_idle(engine))
        request = long_request(engine.info, "busy")
        log = EventLog()
        engine.generate(request, log)
        log.wait_for_events(3)
        # A decoding engine says so (the snapshot may lag a step, hence the wait).
        wait_until(lambda: busy(engine.stats()), 10.0)
        check_stats(engine.stats())
        engine.cancel(request.request_id)
        log.wait()
        idle = wait_idle(engine)
        check_stats(idle)
        if idle.prefix_cache.cached_bytes == 0:  # else the cache's prompts take some room
            assert idle.free_kv_fraction == pytest.approx(1.0)
        else:
            assert idle.free_kv_fraction < 1.0
