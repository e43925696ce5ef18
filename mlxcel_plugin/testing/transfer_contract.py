"""The contract every KV transfer strategy honours; run it on yours.

Subclass ``TransferStrategyContract`` and provide a ``factory`` fixture (what
your plugin registers: ``factory(StrategyOptions) -> TransferStrategy``)::

    import pytest
    from mlxcel_plugin.testing.transfer_contract import TransferStrategyContract

    class TestMyStrategy(TransferStrategyContract):
        @pytest.fixture
        def factory(self):
            return MyStrategy

The rules: whatever a strategy emits, a ``KVAssembler`` rebuilds the cache
bit-exactly when each lane's messages arrive in order but lanes interleave
arbitrarily; each lane opens with a begin; exactly one end; every body fits
one link record; lanes stay within ``options.lanes``.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.kv_serde import DEFAULT_MAX_BODY_BYTES, KVAssembler, KVMessage
from mlxcel_plugin.testing.caches import (
    assert_caches_equal,
    make_cache,
    make_fingerprint,
    make_header,
)
from mlxcel_plugin.transfer import StrategyOptions, plan_transfer

CODECS = builtin_codecs()
KINDS = ["KVCache", "RotatingKVCache", "KVCache"]


def _options(codec: str = "none", lanes: int = 3, chunk_bytes: int = 4096) -> StrategyOptions:
    return StrategyOptions(resolve_codec(codec, CODECS), chunk_bytes=chunk_bytes, lanes=lanes)


def _by_lane(messages: list[KVMessage]) -> dict[int, list[KVMessage]]:
    lanes: dict[int, list[KVMessage]] = defaultdict(list)
    for message in messages:
        lanes[message.lane].append(message)
    return lanes


def interleave_lanes(messages: list[KVMessage], seed: int) -> list[KVMessage]:
    """One possible arrival order: each lane in order, lanes mixed at random."""
    queues = [list(reversed(queue)) for queue in _by_lane(messages).values()]
    rng = random.Random(seed)
    arrived = []
    while queues:
        queue = rng.choice(queues)
        arrived.append(queue.pop())
        if not queue:
            queues.remove(queue)
    return arrived


def assemble(messages: list[KVMessage], fingerprint):
    assembler = KVAssembler(fingerprint, CODECS)
    results = [r for r in (assembler.feed(m) for m in messages) if r is not None]
    assert len(results) == 1, "exactly one message completes the handoff"
    return results[0]


class TransferStrategyContract:
    @pytest.fixture
    def factory(self):
        raise NotImplementedError("provide a `factory` fixture")

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    @pytest.mark.parametrize("tokens", [1, 130, 257])
    @pytest.mark.parametrize("codec", ["none", "lz4"])
    def test_round_trip_any_lane_interleaving(self, factory, dtype, tokens, codec):
        fingerprint = make_fingerprint(3, 2, 64, dtype, KINDS)
        cache = make_cache(fingerprint, tokens, seed=tokens)
        header = make_header(fingerprint, tokens, codec=codec)
        messages = plan_transfer(factory(_options(codec)), header, cache)
        for seed in range(3):
            result = assemble(interleave_lanes(messages, seed), fingerprint)
            assert_caches_equal(result.cache, cache)
            assert result.header == header

    def test_layers_may_be_added_in_any_order(self, factory):
        fingerprint = make_fingerprint(4, 2, 64, "float16")
        cache = make_cache(fingerprint, 40)
        strategy = factory(_options())
        messages = list(strategy.start(make_header(fingerprint, 40)))
        for index in (2, 0, 3, 1):
            messages.extend(strategy.add_layer(index, cache.layers[index]))
        messages.extend(strategy.finish())
        assert_caches_equal(assemble(interleave_lanes(messages, 0), fingerprint).cache, cache)

    def test_message_shape(self, factory):
        fingerprint = make_fingerprint(3, 2, 64, "float32")
        options = _options(lanes=3)
        messages = plan_transfer(
            factory(options), make_header(fingerprint, 200), make_cache(fingerprint, 200)
        )
        assert sum(m.kind == "end" for m in messages) == 1
        assert {m.kind for m in messages} <= {"begin", "chunk", "end"}
        for lane, queue in _by_lane(messages).items():
            assert 0 <= lane < options.lanes
            assert queue[0].kind == "begin", f"lane {lane} must open with begin"
        for message in messages:
            assert len(message.body) <= DEFAULT_MAX_BODY_BYTES
            if message.kind == "chunk":
                assert len(message.body) == message.header["nbytes"]

    def test_chunks_respect_chunk_bytes(self, factory):
        fingerprint = make_fingerprint(2, 2, 64, "float16")
        options = _options(chunk_bytes=8192)
        messages = plan_transfer(
            factory(options), make_header(fingerprint, 300), make_cache(fingerprint, 300)
        )
        chunks = [m for m in messages if m.kind == "chunk"]
        assert chunks and all(len(m.body) <= 8192 for m in chunks)

    def test_refuses_use_after_finish(self, factory):
        fingerprint = make_fingerprint(1, 1, 64, "float16")
        cache = make_cache(fingerprint, 4)
        strategy = factory(_options())
        plan_transfer(strategy, make_header(fingerprint, 4), cache)
        with pytest.raises(HandoffError):
            strategy.add_layer(0, cache.layers[0])

    def test_refuses_a_layer_that_does_not_match_the_header(self, factory):
        fingerprint = make_fingerprint(2, 2, 64, "float16")
        other = make_cache(make_fingerprint(2, 2, 128, "float16"), 4)
        strategy = factory(_options())
        strategy.start(make_header(fingerprint, 4))
        with pytest.raises(HandoffError):
            # Full may defer encoding to finish(); the refusal may come from either call.
            strategy.add_layer(0, other.layers[0])
            strategy.add_layer(1, other.layers[1])
            strategy.finish()
