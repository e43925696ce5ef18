"""Every registered engine passes the shared engine contract on the tiny checkpoint."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxcel_plugin.engine_api import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    CacheState,
    EngineConfig,
    TokenEvent,
)
from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint
from mlxcel_plugin.testing.engine_contract import (
    EngineContract,
    EventLog,
    check_cache_matches,
    check_stream,
)

# Every installed plugin, as `mlxcel-server` would load them (third-party engines included).
REGISTRY = load_plugins()
# Warmup only costs time here; the contract exercises the same paths anyway.
CONFIG = EngineConfig(warmup=False, chunk_size_tokens=32)


# Engines whose checkpoint is not a model run the same contract over their own checkpoint in
# their own test module (synthetic-kv: tests/engines/test_synthetic_kv.py).
OWN_CHECKPOINT = {"synthetic-kv"}


class TestRegisteredEngines(EngineContract):
    @pytest.fixture(params=[n for n in REGISTRY.names("engine") if n not in OWN_CHECKPOINT])
    def engine_factory(self, request, tiny_model_path):
        factory = REGISTRY.get("engine", request.param)
        return lambda: factory(str(tiny_model_path), CONFIG)


# --- the contract's own checks catch what they should ---------------------------------


def _log(*events: TokenEvent) -> EventLog:
    log = EventLog()
    for event in events:
        log(event)
    return log


def _token(index: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent("r", index, 100 + index, finish)


def test_check_stream_accepts_a_well_formed_stream():
    check_stream(_log(_token(0), _token(1), _token(2, FINISH_LENGTH)), 0, 3)
    check_stream(_log(_token(1), TokenEvent("r", 2, None, FINISH_CANCELLED)), 1, 9)


@pytest.mark.parametrize(
    "events, first_index, max_tokens",
    [
        ((_token(0), _token(2, FINISH_LENGTH)), 0, 9),  # a gap
        ((_token(0), _token(0), _token(1, FINISH_LENGTH)), 0, 9),  # a repeat
        ((_token(0, FINISH_STOP), _token(1, FINISH_STOP)), 0, 9),  # two terminal events
        ((_token(0), _token(1)), 0, 9),  # no terminal event
        ((_token(0), _token(1), _token(2, FINISH_LENGTH)), 0, 2),  # over max_tokens
        ((_token(0), _token(1, FINISH_LENGTH)), 1, 9),  # a decode must start at 1
        ((TokenEvent("r", 0, None), _token(1, FINISH_LENGTH)), 0, 9),  # a tokenless middle
    ],
    ids=["gap", "repeat", "two-ends", "no-end", "over-budget", "decode-at-0", "tokenless"],
)
def test_check_stream_refuses(events, first_index, max_tokens):
    with pytest.raises(AssertionError):
        check_stream(_log(*events), first_index, max_tokens)


FINGERPRINT = make_fingerprint(num_layers=3, kv_heads=2, head_dim=16, dtype="float16")


def test_check_cache_matches_accepts_a_matching_cache():
    check_cache_matches(make_cache(FINGERPRINT, 5), FINGERPRINT.to_dict(), 5)


@pytest.mark.parametrize(
    "damage",
    [
        lambda c: CacheState(c.layers[:-1]),
        lambda c: CacheState([replace(c.layers[0], offset=4), *c.layers[1:]]),
        lambda c: CacheState([replace(c.layers[0], kind="RotatingKVCache"), *c.layers[1:]]),
        lambda c: CacheState([replace(c.layers[0], dtype="bfloat16"), *c.layers[1:]]),
        lambda c: CacheState([replace(c.layers[0], keys=c.layers[0].keys[:, :1]), *c.layers[1:]]),
        lambda c: CacheState(
            [replace(c.layers[0], keys=c.layers[0].keys.astype("<f4")), *c.layers[1:]]
        ),
    ],
    ids=["missing-layer", "offset", "kind", "dtype-name", "kv-heads", "storage-dtype"],
)
def test_check_cache_matches_refuses(damage):
    with pytest.raises(AssertionError):
        check_cache_matches(damage(make_cache(FINGERPRINT, 5)), FINGERPRINT.to_dict(), 5)
