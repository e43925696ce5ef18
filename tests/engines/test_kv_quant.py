"""[engine] kv_bits: K/V quantized once prefilled; hybrid == prefill -> handoff -> decode."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from engines.kv_quant import KVQuantizer, mergeable
from engines.mlx_engine import MlxEngine
from engines.tiny_models import ensure_arch_model
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.kv_serde.header import ModelFingerprint
from tests.conftest import model_cache_root
from tests.engines import support

KV8 = EngineConfig(kv_bits=8, kv_group_size=32, chunk_size_tokens=32, warmup=False)
PROMPT = tuple(range(100, 190))


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(ensure_arch_model("llama", root=model_cache_root(), head_dim=32))


@pytest.fixture(scope="module")
def engine(model_path):
    eng = MlxEngine.from_path(model_path, KV8)
    eng.start()
    yield eng
    eng.close()


def test_bad_bits_or_group_sizes_are_refused():
    with pytest.raises(ConfigError, match="kv_bits"):
        KVQuantizer(EngineConfig(kv_bits=7))
    with pytest.raises(ConfigError, match="kv_group_size"):
        KVQuantizer(EngineConfig(kv_bits=8, kv_group_size=16))
    assert not KVQuantizer(EngineConfig()).enabled


def test_only_plain_kv_caches_are_quantized():
    quantizer = KVQuantizer(KV8)
    rotating = RotatingKVCache(max_size=8)
    assert quantizer.cache(rotating) is rotating
    empty = quantizer.cache(KVCache())
    assert isinstance(empty, QuantizedKVCache) and (empty.bits, empty.group_size) == (8, 32)
    assert not mergeable([empty]) and mergeable([rotating, KVCache()])


def test_the_fingerprint_describes_the_quantized_layers(engine):
    fingerprint = ModelFingerprint.from_dict(engine.info.fingerprint)
    assert set(fingerprint.cache_classes) == {"QuantizedKVCache"}
    names = fingerprint.layers[0].names
    assert names == ("k", "k.scales", "k.biases", "v", "v.scales", "v.biases")


def _handed_off(engine, rid: str, sampling: SamplingParams) -> list[int]:
    request = GenerationRequest(rid, PROMPT, 8, sampling=sampling)
    outcome = support.PrefillOutcome()
    engine.prefill(request, outcome.on_done, outcome.on_layer)
    result = outcome.wait()
    assert {layer.kind for layer in result.cache.layers} == {"QuantizedKVCache"}
    events = support.Events()
    engine.decode(request, result.first_token, result.cache, events)
    events.wait()
    return [result.first_token, *events.tokens]


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)],
                         ids=["greedy", "seeded"])
def test_prefill_handoff_decode_gives_the_hybrid_tokens(engine, sampling):
    hybrid = support.generate(engine, GenerationRequest("h", PROMPT, 8, sampling=sampling))
    assert _handed_off(engine, "p", sampling) == hybrid.tokens


def test_quantized_sequences_decode_side_by_side(engine):
    """No batch form: each sequence its own group, all stepped together, same tokens."""
    alone = support.generate(engine, GenerationRequest("a", PROMPT, 8)).tokens
    runs = [support.Events() for _ in range(3)]
    for i, events in enumerate(runs):
        engine.generate(GenerationRequest(f"b{i}", PROMPT, 8), events)
    assert [events.wait() and events.tokens for events in runs] == [alone] * 3
