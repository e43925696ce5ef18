"""The zero-compute KV source (engines/synthetic_kv.py): the engine contract, the K/V it
fills, its fingerprint, and a handoff that a second engine adopts and decodes."""

from __future__ import annotations

import numpy as np
import pytest

from engines.plugin import make_synthetic_kv_engine
from engines.synthetic_kv import (
    PATTERN_TOKENS,
    kv_bytes_per_token,
    load_synthetic_model,
    synthetic_config,
    write_synthetic_checkpoint,
)
from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.testing.engine_contract import EngineContract
from mlxcel_plugin.testing.engine_harness import (
    EventLog,
    generate,
    make_request,
    prefill,
    through_the_wire,
)

SMALL = {"layers": 3, "kv_heads": 2, "head_dim": 32}  # the mechanics, at test size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic"), **SMALL)


def started(path, **config) -> object:
    engine = make_synthetic_kv_engine(str(path), EngineConfig(warmup=False, **config))
    engine.start()
    return engine


class TestSyntheticKVEngine(EngineContract):
    @pytest.fixture
    def engine_factory(self, checkpoint):
        return lambda: make_synthetic_kv_engine(str(checkpoint), EngineConfig(warmup=False))


def test_the_default_shape_is_an_8b_models_kv():
    # 32 layers x 8 KV heads x head_dim 128 x bf16, K and V: 128 KiB a token, 1 GiB at 8k.
    assert kv_bytes_per_token(synthetic_config()) * 8192 == 1 << 30


def test_fingerprint_follows_the_asked_shape(checkpoint):
    engine = make_synthetic_kv_engine(str(checkpoint), EngineConfig(warmup=False))
    fingerprint = engine.info.fingerprint
    assert (fingerprint["num_layers"], fingerprint["kv_heads"], fingerprint["head_dim"]) == (3, 2,
                                                                                          32)
    assert fingerprint["dtype"] == "bfloat16"


def test_prefill_fills_every_layer_with_the_pattern(checkpoint):
    import mlx.core as mx

    model, _ = load_synthetic_model(checkpoint)  # same seed: the pattern the engine fills
    pattern_bits = np.array(model._kv_pattern.view(mx.uint16))[:, :, :PATTERN_TOKENS]
    engine = started(checkpoint)
    try:
        request = make_request(engine.info, "p", max_tokens=2, prompt_tokens=300)
        result, _ = prefill(engine, request)
    finally:
        engine.close()
    layers = result.cache.layers
    assert len(layers) == SMALL["layers"]
    for index, layer in enumerate(layers[:2]):
        keys = layer.keys.view(np.uint16)  # bf16 travels as uint16
        assert keys.shape == (1, SMALL["kv_heads"], 300, SMALL["head_dim"])
        # Positions filled by the chunked forwards follow the pattern exactly (the last
        # token alone is computed by the model).
        rows = (np.arange(299) + 97 * index) % PATTERN_TOKENS
        expected = pattern_bits[:, :, rows]
        assert np.array_equal(keys[:, :, :299], expected)
        assert not np.array_equal(keys[:, :, 0], keys[:, :, 1])  # not a constant fill


def test_two_engines_from_one_checkpoint_hand_off_and_decode_alike(checkpoint):
    """A decode engine adopts the filled cache (through the wire) and decodes like hybrid."""
    first, second = started(checkpoint), started(checkpoint)
    try:
        assert first.info.fingerprint == second.info.fingerprint
        request = make_request(first.info, "h", max_tokens=6, prompt_tokens=600)
        hybrid = generate(first, request).tokens
        result, _ = prefill(first, request)
        cache = through_the_wire(result, second.info, receiver=second)
        log = EventLog()
        second.decode(request, result.first_token, cache, log)
        split = [result.first_token, *log.wait().tokens]
    finally:
        first.close()
        second.close()
    assert split == hybrid
    assert len(hybrid) == 6


def test_a_plain_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="not a synthetic KV source"):
        load_synthetic_model(tmp_path)
