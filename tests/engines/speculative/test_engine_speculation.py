"""MlxEngine with ``[speculative] method = "ngram"``: concurrent requests with and without
speculation (and with sampling and logprobs) get what a plain engine gives each alone."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams
from mlxcel_plugin.speculative.settings import SpeculativeConfig
from tests.engines import support

MAX_TOKENS = 64
# Prompts after which the tiny model's greedy reply repeats its own earlier tokens (it
# copies nothing from a prompt): proposals made there are accepted.
SEEDS = (18, 24, 27, 22, 14)


def engine_pair(model_path, config: SpeculativeConfig) -> Iterator[tuple[MlxEngine, MlxEngine]]:
    """A plain engine and a speculating one on the same checkpoint, started, then closed."""
    plain = MlxEngine.from_path(str(model_path), EngineConfig())
    spec = MlxEngine.from_path(str(model_path), EngineConfig(speculative=config))
    plain.start()
    spec.start()
    yield plain, spec
    plain.close()
    spec.close()


@pytest.fixture(scope="module")
def engines(tiny_model_path):
    # Not adaptive: a mixed batch of 5 would mostly verify nothing (group_rule.py).
    yield from engine_pair(tiny_model_path, SpeculativeConfig(method="ngram", adaptive=False))


def repetitive_prompt(seed: int) -> tuple[int, ...]:
    """A random 'file' and an 'edit request' repeating most of it (prompt lookup's case)."""
    rng = np.random.default_rng(seed)
    body = tuple(int(t) for t in rng.integers(3, 4000, 48))
    return body + (7, 11) + body[:32]


def requests() -> list[GenerationRequest]:
    plain_off = SamplingParams(speculative="off")
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42)
    with_logprobs = SamplingParams(logprobs=2)
    samplings = [SamplingParams(), SamplingParams(), plain_off, seeded, with_logprobs]
    return [GenerationRequest(f"r{seed}", repetitive_prompt(seed), MAX_TOKENS, sampling=sampling)
            for seed, sampling in zip(SEEDS, samplings, strict=True)]


def concurrently(engine: MlxEngine, batch: list[GenerationRequest]) -> list[support.Events]:
    events = [support.Events() for _ in batch]
    for request, sink in zip(batch, events, strict=True):
        engine.generate(request, sink)
    for sink in events:
        sink.wait()
    return events


def test_a_mixed_batch_gives_each_request_its_plain_output(engines):
    plain, spec = engines
    batch = requests()
    expected = [support.generate(plain, request) for request in batch]
    before = spec.stats().speculative.methods.get("ngram")
    got = concurrently(spec, batch)
    for request, want, have in zip(batch, expected, got, strict=True):
        assert have.tokens == want.tokens, request.request_id
        assert [e.index for e in have.events] == list(range(MAX_TOKENS))  # one event a token
        assert [e.logprobs for e in have.events] == [e.logprobs for e in want.events]
    counts = spec.stats().speculative.methods["ngram"]
    assert before is None or counts.proposed > before.proposed
    assert counts.accepted > 0  # speculation took tokens, so the equality above means something


def test_structured_output_with_speculation_is_the_plain_output(engines):
    """Each verified row goes through the grammar in order: the constraint holds row by row."""
    from tests.engines.test_grammar import EOS, SCHEMAS, grammar

    plain, spec = engines
    for name in ("array_of_objects", "bounded_array", "nested"):
        sampling = SamplingParams(grammar=grammar(SCHEMAS[name]), speculative="ngram")
        request = GenerationRequest(f"g-{name}", repetitive_prompt(1), 80, sampling,
                                    stop_token_ids=(EOS,))
        want = support.generate(plain, request)
        have = support.generate(spec, request)
        assert have.tokens == want.tokens, name
        assert have.last.finish_reason == want.last.finish_reason
