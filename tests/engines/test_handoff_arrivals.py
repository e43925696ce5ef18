"""HandoffArrivals: a handoff's adoption, join and prefix store fall in different iterations
while sequences decode; all at once while idle; the same tokens and cached bytes either way."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from engines.handoff_arrivals import MAX_WAITING_STORES, HandoffArrivals, decoded_in_place
from engines.mlx_engine import MlxEngine
from engines.prefix.cache import SHARE_MIN_BYTES
from mlxcel_plugin.engine_api import (
    EngineConfig,
    GenerationRequest,
    PrefixCacheConfig,
    release_prefix,
    reserve_prefix,
)
from tests.engines import support
from tests.engines.prefix.test_cache import CHUNK, make_engine, tokens


@dataclass
class FakeSequence:
    request_id: str


@dataclass
class FakeBatch:
    sequences: list[FakeSequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, sequences: list[FakeSequence], caches: list) -> None:
        self.sequences += sequences


@dataclass
class FakePrefix:
    stored: list[tuple[tuple[int, ...], int]] = field(default_factory=list)  # (tokens, share)

    def store_received(self, prompt: tuple[int, ...], caches: list, share_min_bytes: int) -> None:
        self.stored.append((prompt, share_min_bytes))


def wait_for_tokens(events: support.Events, n: int) -> None:
    deadline = time.monotonic() + support.WAIT_S
    while len(events.events) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(events.events)
        time.sleep(0.001)


def cache(offset: int, held: int) -> KVCache:
    layer = KVCache()
    layer.state = (mx.zeros((1, 2, held, 4)), mx.zeros((1, 2, held, 4)), offset)
    return layer


class Engine:
    """The engine loop's calls into HandoffArrivals, with a running stream in the batch."""

    def __init__(self, running: bool = True):
        self.prefix, self.fits = FakePrefix(), []
        self.arrivals = HandoffArrivals(lambda: self.fits.append(1))
        self.batch = FakeBatch([FakeSequence("stream")] if running else [])
        self.waiting: deque = deque()

    def hand_off(self, request_id: str, prompt: tuple[int, ...] = (1, 2, 3)) -> None:
        self.arrivals.store_later(request_id, self.prefix, prompt, [cache(3, 8)])
        self.waiting.append((FakeSequence(request_id), [cache(3, 8)]))
        self.arrivals.adopted(decoding=bool(len(self.batch)))

    def iteration(self) -> bool:
        joined = self.arrivals.admit(self.waiting, self.batch, max_batch_size=8)
        self.arrivals.after_step(self.batch, self.waiting)
        return joined

    def end(self, request_id: str) -> None:
        self.batch.sequences = [s for s in self.batch.sequences if s.request_id != request_id]


def test_while_decoding_the_join_and_the_store_each_wait_for_a_later_iteration():
    engine = Engine()
    engine.hand_off("h")
    assert not engine.iteration()  # adopted here: neither joined nor stored
    assert engine.prefix.stored == [] and len(engine.waiting) == 1
    assert engine.iteration()  # joins (its first forward): still not stored
    assert engine.prefix.stored == []
    engine.iteration()  # the first iteration that adopted and joined nothing
    assert engine.prefix.stored == [((1, 2, 3), SHARE_MIN_BYTES)] and engine.fits == [1]
    assert not engine.arrivals


def test_an_ended_sequence_is_stored_after_its_step():
    engine = Engine()
    engine.hand_off("h")
    engine.iteration()
    engine.arrivals.admit(engine.waiting, engine.batch, 8)
    engine.end("h")  # its first step was its last
    assert engine.arrivals.after_step(engine.batch, engine.waiting) == 1
    assert engine.prefix.stored


def test_store_now_and_flush_run_at_once():
    engine = Engine()
    engine.hand_off("a")
    engine.hand_off("b")
    assert engine.arrivals.store_now("b") == 1 and engine.prefix.stored[0][0] == (1, 2, 3)
    assert engine.arrivals.store_now("b") == 0
    assert engine.arrivals.flush() == 1 and not engine.arrivals


def test_with_nothing_decoding_everything_runs_at_once():
    engine = Engine(running=False)
    engine.hand_off("h")
    assert engine.prefix.stored  # at adoption
    assert engine.iteration()  # and it joins in the same iteration


def test_stores_cannot_wait_without_bound():
    engine = Engine()
    for i in range(MAX_WAITING_STORES + 2):
        engine.hand_off(f"h{i}")
    engine.iteration()  # adopted: one store anyway, as more than the bound wait
    assert len(engine.prefix.stored) == 1
    engine.iteration()  # joined: again
    assert len(engine.prefix.stored) == 2
    engine.iteration()  # quiet, with the bound's worth waiting: one, as always
    assert len(engine.prefix.stored) == 3


def test_caches_decoded_in_place_are_shared_others_copied():
    assert decoded_in_place([cache(4, 8), cache(4, 8)], 3)  # stepped: own buffers
    assert not decoded_in_place([cache(3, 8)], 3)  # never written (merged into a group)
    engine = Engine()
    engine.arrivals.store_later("h", engine.prefix, (1, 2, 3), [cache(5, 8)])
    engine.arrivals.flush()
    assert engine.prefix.stored == [((1, 2, 3), 0)]


@pytest.mark.parametrize("handed_tokens", [6, 2])  # 2: it ends at its (sliced) first forward
def test_a_handoff_joining_a_running_stream_decodes_and_is_cached_as_at_once(
    tiny_model_path, handed_tokens
):
    """Paced adoption on the tiny model (its first forward in slices of layers, after the
    stream's steps): the stream's and the handoff's tokens match their
    runs alone, and the prompt's entry holds the bytes the prefill computed, in the very
    buffers the sequence decoded into (a view with room past the prompt, not a copy)."""
    decode, prefill = make_engine(tiny_model_path, 1 << 30), make_engine(tiny_model_path, 0)
    try:
        stream = GenerationRequest("stream", tokens(40, seed=3), 24)
        handed = GenerationRequest("handed", tokens(600, seed=4), handed_tokens)
        alone = [support.generate(prefill, r).tokens for r in (stream, handed)]
        result = support.prefill(prefill, handed)
        running = support.Events()
        decode.generate(stream, running)
        wait_for_tokens(running, 2)
        assert support.decode_after(decode, handed, result) == alone[1]
        assert running.wait() and running.tokens == alone[0]
        assert decode._arrivals._sliced.begun == 1  # its first forward ran in slices
        assert reserve_prefix(decode, "probe", handed.prompt_tokens, 512)
        pin = decode._prefix._pins["probe"]
        for held, sent in zip(pin.caches, result.cache.layers, strict=True):
            assert held.keys.shape[2] > 512  # the sequence's own buffer, shared
            assert np.array_equal(np.array(held.keys[..., :512, :]), sent.keys[..., :512, :])
        release_prefix(decode, "probe")
    finally:
        decode.close()
        prefill.close()


def test_a_sliced_handoff_that_ends_at_its_first_forward_keeps_its_reply(tiny_model_path):
    """``reuse_generated``: a handoff ending at its sliced first forward is kept as a finished
    sequence is (its prompt and first token), so its next turn reuses one token more."""
    prefix = PrefixCacheConfig(max_bytes=1 << 30, reuse_generated=True)
    config = EngineConfig(chunk_size_tokens=CHUNK, prefix_cache=prefix)
    decode = MlxEngine.from_path(str(tiny_model_path), config)
    decode.start()
    prefill = make_engine(tiny_model_path, 0)
    try:
        stream = GenerationRequest("stream", tokens(40, seed=3), 24)
        handed = GenerationRequest("handed", tokens(600, seed=4), 2)
        result = support.prefill(prefill, handed)
        running = support.Events()
        decode.generate(stream, running)
        wait_for_tokens(running, 2)
        replied = support.decode_after(decode, handed, result)
        assert decode._arrivals._sliced.begun == 1 and running.wait()
        turn = GenerationRequest("next", handed.prompt_tokens + tuple(replied) + tokens(20, 5), 2)
        assert support.generate(decode, turn).events[0].cached_tokens == 600 + 1
    finally:
        decode.close()
        prefill.close()
