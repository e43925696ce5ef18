"""SmolLM2-135M as its own draft, and with prompt lookup: greedy replies equal plain greedy
decoding on a chat question (in a child with OpenBLAS under MLX: tests/openblas_child.py).
One short prompt: the longer prompts and the flip rate over 32 prompts, code edits and tool
calls included, are ``loadtests/bench_speculative.py``'s (docs/speculative.md)."""

from __future__ import annotations

import pytest

from engines.mlx_engine import MlxEngine
from loadtests.speculative_workloads import chat_prompts
from mlxcel_plugin.engine_api import (
    EngineConfig,
    GenerationRequest,
    PrefixCacheConfig,
    SamplingParams,
)
from mlxcel_plugin.speculative.settings import SpeculativeConfig
from tests.engines import support

MAX_TOKENS = 16
REPLY_TIMEOUT_S = 300  # SmolLM2 on a loaded CPU
pytestmark = [pytest.mark.smollm2, pytest.mark.openblas_child, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(smollm2_model_path):
    """One engine: plain replies are asked per request (``speculative: "off"``), so one model
    and one draft load; no prefix cache, so no start-up reuse probe (not what is tested)."""
    path = str(smollm2_model_path)
    config = EngineConfig(speculative=SpeculativeConfig(method="ngram", draft_model=path),
                          prefix_cache=PrefixCacheConfig(max_bytes=0, granularity="chunk"))
    engine = MlxEngine.from_path(path, config)
    engine.start()
    yield engine
    engine.close()


def generate(engine: MlxEngine, request: GenerationRequest) -> list[int]:
    events = support.Events()
    engine.generate(request, events)
    assert events.done.wait(REPLY_TIMEOUT_S), f"{request.request_id}: no reply"
    return events.tokens


def test_own_draft_and_prompt_lookup_equal_plain_greedy(engine, smollm2_model_path):
    path = str(smollm2_model_path)
    prompts = [chat_prompts(path, 1)[0]]
    for i, prompt in enumerate(prompts):
        replies = {}
        for method in ("off", "draft", "ngram"):
            request = GenerationRequest(f"{method}{i}", prompt, MAX_TOKENS,
                                        sampling=SamplingParams(speculative=method))
            replies[method] = generate(engine, request)
        assert replies["draft"] == replies["off"], i
        assert replies["ngram"] == replies["off"], i
    draft = engine.stats().speculative.methods["draft"]
    assert draft.accepted >= 0.8 * draft.proposed > 0  # its own draft: nearly every proposal
