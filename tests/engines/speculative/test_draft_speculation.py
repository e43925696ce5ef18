"""MlxEngine with ``[speculative] method = "draft"``: a noisy copy of the tiny model drafts
(it agrees with the target often, not always), so steps accept some proposals and reject
others; every request still gets what a plain engine gives it alone: greedy and seeded
tokens, logprobs, grammar-constrained output, a handed-off or migrated sequence
continued. A draft whose tokenizer differs is refused at start with one line.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.speculative.settings import MethodCounts, SpeculativeConfig
from tests.engines import support
from tests.engines.speculative.drafts import noisy_copy, swapped_tokenizer_copy
from tests.engines.speculative.test_engine_speculation import (
    concurrently,
    engine_pair,
    repetitive_prompt,
)

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def draft_path(tiny_model_path, tmp_path_factory):
    return noisy_copy(tiny_model_path, tmp_path_factory.mktemp("draft") / "noisy")


@pytest.fixture(scope="module")
def engines(tiny_model_path, draft_path):
    # Not adaptive: every step drafts, whatever the batch (the rule is tested on its own).
    config = SpeculativeConfig(method="draft", draft_model=str(draft_path), adaptive=False)
    yield from engine_pair(tiny_model_path, config)


def request(name: str, prompt_seed: int, **sampling) -> GenerationRequest:
    rng = np.random.default_rng(prompt_seed)
    prompt = tuple(int(t) for t in rng.integers(3, 4000, 24 + prompt_seed))
    return GenerationRequest(name, prompt, MAX_TOKENS, sampling=SamplingParams(**sampling))


def test_a_batch_mixing_draft_ngram_and_plain_gives_each_its_plain_output(engines):
    plain, spec = engines
    batch = [request("draft-a", 1), request("draft-b", 2), request("logprobs", 3, logprobs=2),
             # The tiny model repeats itself after ~40 tokens here: prompt lookup's case.
             GenerationRequest("ngram", repetitive_prompt(18), 64,
                               sampling=SamplingParams(speculative="ngram")),
             request("off", 4, speculative="off")]
    expected = [support.generate(plain, r) for r in batch]
    got = concurrently(spec, batch)
    for r, want, have in zip(batch, expected, got, strict=True):
        assert have.tokens == want.tokens, r.request_id
        assert [e.index for e in have.events] == list(range(r.max_tokens))  # one event a token
        assert [e.logprobs for e in have.events] == [e.logprobs for e in want.events]
    methods = spec.stats().speculative.methods
    assert 0 < methods["draft"].accepted < methods["draft"].proposed  # kept some, not all
    assert methods["ngram"].proposed > 0


def test_seeded_sampling_with_a_draft_is_plain_seeded_sampling(engines):
    """Seeded: argmax proposals judged by the plain sampler, so the very same tokens."""
    plain, spec = engines
    seeded = request("seeded", 5, temperature=0.3, top_p=0.95, seed=11)
    before = spec.stats().speculative.methods.get("draft", MethodCounts())
    assert support.generate(spec, seeded).tokens == support.generate(plain, seeded).tokens
    assert spec.stats().speculative.methods["draft"].accepted > before.accepted


def test_unseeded_sampling_drafts_by_the_rejection_rule(engines):
    """Proposals drawn from the draft; the rule keeps some (its distribution: unit tests)."""
    _, spec = engines
    before = spec.stats().speculative.methods.get("draft", MethodCounts())
    batch = [request(f"free-{i}", 9 + i, temperature=0.7) for i in range(3)]
    for events in concurrently(spec, batch):
        # Each runs to its end: max_tokens, or sooner where a sampled token is EOS (the tiny
        # model sampled one at token 26 once in a suite run).
        assert events.last.finish_reason in (FINISH_LENGTH, FINISH_STOP)
        assert (len(events.tokens) == MAX_TOKENS) == (events.last.finish_reason == FINISH_LENGTH)
        if events.last.finish_reason == FINISH_STOP:  # ended by the EOS it sampled, no sooner
            assert events.tokens[-1] in spec.info.eos_token_ids
    assert spec.stats().speculative.methods["draft"].accepted > before.accepted


def test_a_migrated_drafting_stream_continues_with_the_same_tokens(engines):
    """Migration: prompt + streamed tokens placed anew; the draft prefills on all of them."""
    _, spec = engines
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, seed=4)):
        whole = GenerationRequest("whole", request("w", 10).prompt_tokens, MAX_TOKENS, sampling)
        tokens = support.generate(spec, whole).tokens
        moved = dataclasses.replace(whole, request_id="moved", max_tokens=MAX_TOKENS - 7,
                                    prompt_tokens=whole.prompt_tokens + tuple(tokens[:7]))
        assert support.generate(spec, moved).tokens == tokens[7:]


def test_structured_output_with_a_draft_is_the_plain_output(engines):
    from tests.engines.test_grammar import EOS, SCHEMAS, grammar

    plain, spec = engines
    sampling = SamplingParams(grammar=grammar(SCHEMAS["nested"]))
    constrained = GenerationRequest("g", repetitive_prompt(1), 80, sampling,
                                    stop_token_ids=(EOS,))
    want, have = support.generate(plain, constrained), support.generate(spec, constrained)
    assert have.tokens == want.tokens
    assert have.last.finish_reason == want.last.finish_reason


def test_a_handed_off_sequence_drafts_from_its_prompt(engines):
    """A decode engine prefills the draft itself from the handoff's prompt tokens."""
    plain, spec = engines
    handed = request("handoff", 8)
    before = spec.stats().speculative.methods["draft"].proposed
    done = support.prefill(plain, handed)
    events = support.Events()
    spec.decode(handed, done.first_token, done.cache, events)
    events.wait()
    assert [done.first_token, *events.tokens] == support.generate(plain, handed).tokens
    assert spec.stats().speculative.methods["draft"].proposed > before


def test_a_draft_with_another_tokenizer_is_refused_at_start(tiny_model_path, tmp_path):
    wrong = swapped_tokenizer_copy(tiny_model_path, tmp_path / "wrong")
    config = SpeculativeConfig(method="draft", draft_model=str(wrong))
    with pytest.raises(ConfigError, match="tokenizer is not the target's") as refused:
        MlxEngine.from_path(str(tiny_model_path), EngineConfig(speculative=config))
    assert "\n" not in str(refused.value)
    assert "'hello'" in str(refused.value) or "'world'" in str(refused.value)
