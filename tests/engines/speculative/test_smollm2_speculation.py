"""SmolLM2-135M as its own draft, and with prompt lookup: greedy replies equal plain greedy
decoding on a code edit, a tool-call turn and a chat question (the flip rate measured by
``loadtests/bench_speculative.py`` over 32 prompts is in docs/speculative.md)."""

from __future__ import annotations

import pytest

from engines.mlx_engine import MlxEngine
from loadtests.speculative_workloads import chat_prompts, code_edit_prompts, tool_call_prompts
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams
from mlxcel_plugin.speculative.settings import SpeculativeConfig
from tests.engines import support

MAX_TOKENS = 24
pytestmark = [pytest.mark.smollm2, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engines(smollm2_model_path):
    path = str(smollm2_model_path)
    plain = MlxEngine.from_path(path, EngineConfig())
    config = SpeculativeConfig(method="ngram", draft_model=path)  # "draft" per request
    spec = MlxEngine.from_path(path, EngineConfig(speculative=config))
    plain.start()
    spec.start()
    yield plain, spec
    plain.close()
    spec.close()


def test_own_draft_and_prompt_lookup_equal_plain_greedy(engines, smollm2_model_path):
    plain, spec = engines
    path = str(smollm2_model_path)
    prompts = [code_edit_prompts(path, 1)[0], tool_call_prompts(path, 1)[0],
               chat_prompts(path, 1)[0]]
    for i, prompt in enumerate(prompts):
        want = support.generate(plain, GenerationRequest(f"p{i}", prompt, MAX_TOKENS)).tokens
        for method in ("draft", "ngram"):
            request = GenerationRequest(f"{method}{i}", prompt, MAX_TOKENS,
                                        sampling=SamplingParams(speculative=method))
            assert support.generate(spec, request).tokens == want, (i, method)
    draft = spec.stats().speculative.methods["draft"]
    assert draft.accepted >= 0.8 * draft.proposed  # its own draft: nearly every proposal
