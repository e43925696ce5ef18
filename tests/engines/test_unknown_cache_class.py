"""A cache class with no handoff form: refused per prefill by name (501), hybrid still serves."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import KVCache

import engines.cache_layout as cache_layout
import engines.prefill as prefill
from engines import kv_convert
from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest
from mlxcel_plugin.errors import CacheNotTransferableError
from mlxcel_plugin.kv_serde.header import ModelFingerprint
from tests.engines import support


class MysteryCache(KVCache):
    """A newer mlx-lm's class, as this one sees it: a subclass may hold more than its base."""


def mystery_caches(model, *args, **kwargs):
    return [MysteryCache() for _ in model.layers]


def test_a_subclass_has_no_handoff_form():
    with pytest.raises(CacheNotTransferableError, match="MysteryCache"):
        cache_layout.live_arrays(MysteryCache())
    with pytest.raises(CacheNotTransferableError, match="MysteryCache") as refused:
        kv_convert.check_cache_kinds([KVCache(), MysteryCache()])
    assert refused.value.status_code == 501
    assert refused.value.to_openai()["error"]["code"] == "cache_not_transferable"


def test_prefill_is_refused_naming_the_class_and_the_engine_keeps_serving(
        tiny_model_path, monkeypatch):
    monkeypatch.setattr(cache_layout, "make_prompt_cache", mystery_caches)
    monkeypatch.setattr(prefill, "make_prompt_cache", mystery_caches)
    engine = MlxEngine.from_path(str(tiny_model_path), EngineConfig(warmup=False))
    engine.start()
    try:
        assert "MysteryCache" in ModelFingerprint.from_dict(engine.info.fingerprint).cache_classes
        request = GenerationRequest("p", tuple(range(3, 40)), 4)
        outcome = support.PrefillOutcome()
        engine.prefill(request, outcome.on_done, outcome.on_layer)
        refused = outcome.wait()
        assert isinstance(refused, CacheNotTransferableError) and "MysteryCache" in str(refused)
        assert outcome.layer_order == []  # refused before computing anything
        events = support.generate(engine, GenerationRequest("h", tuple(range(3, 40)), 4))
        assert len(events.tokens) == 4  # hybrid serving goes on
    finally:
        engine.close()
