"""SmolLM2-135M as its own draft, and with prompt lookup: greedy replies equal plain greedy
decoding on a tool-call turn and a chat question (short prompts: a code edit's 1k-token
prefill is the bench's; the flip rate ``loadtests/bench_speculative.py`` measured over 32
prompts, code edits included, is in docs/speculative.md)."""

from __future__ import annotations

import pytest

from engines.mlx_engine import MlxEngine
from loadtests.speculative_workloads import chat_prompts, tool_call_prompts
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams
from mlxcel_plugin.speculative.settings import SpeculativeConfig
from tests.engines import support

MAX_TOKENS = 16
REPLY_TIMEOUT_S = 600  # SmolLM2 on a loaded CPU: a 1k-token prefill alone may take a minute
pytestmark = [pytest.mark.smollm2, pytest.mark.timeout(1800)]


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


def generate(engine: MlxEngine, request: GenerationRequest) -> list[int]:
    events = support.Events()
    engine.generate(request, events)
    assert events.done.wait(REPLY_TIMEOUT_S), f"{request.request_id}: no reply"
    return events.tokens


def test_own_draft_and_prompt_lookup_equal_plain_greedy(engines, smollm2_model_path):
    plain, spec = engines
    path = str(smollm2_model_path)
    prompts = [tool_call_prompts(path, 1)[0], chat_prompts(path, 1)[0]]
    for i, prompt in enumerate(prompts):
        want = generate(plain, GenerationRequest(f"p{i}", prompt, MAX_TOKENS))
        for method in ("draft", "ngram"):
            request = GenerationRequest(f"{method}{i}", prompt, MAX_TOKENS,
                                        sampling=SamplingParams(speculative=method))
            assert generate(spec, request) == want, (i, method)
    draft = spec.stats().speculative.methods["draft"]
    assert draft.accepted >= 0.8 * draft.proposed  # its own draft: nearly every proposal
