"""The real embedded SmolLM2-135M-Instruct through the engine and its chat template."""

from __future__ import annotations

import pytest

from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import (
    FINISH_STOP,
    EngineConfig,
    GenerationRequest,
    PrefixCacheConfig,
)
from tests.engines import support


@pytest.mark.smollm2
@pytest.mark.openblas_child
def test_capital_of_france_is_paris(smollm2_model_path):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_model_path))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text)
    # Whole-chunk reuse: the start-up probe is not what this test checks, and on MLX's
    # reference BLAS (in-process tests) it cost SmolLM2 about two minutes.
    config = EngineConfig(warmup=False, prefix_cache=PrefixCacheConfig(granularity="chunk"))
    engine = MlxEngine.from_path(str(smollm2_model_path), config)
    engine.start()
    try:
        req = GenerationRequest("paris", tuple(ids), max_tokens=48)
        events = support.generate(engine, req)
        split = support.split(engine, req)
    finally:
        engine.close()
    answer = tok.decode(events.tokens, skip_special_tokens=True)
    assert "Paris" in answer
    assert events.last.finish_reason == FINISH_STOP
    assert split == events.tokens
