"""Logprobs on the MLX engine (tiny model): raw model logprobs, the same in every role."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from engines.mlx_engine import MlxEngine
from engines.model_loader import load_mlx_model
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams
from tests.engines import support

CHUNK = 8  # prompts of ~20 tokens cross chunk boundaries
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=11)


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(3, 49152, n))


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = MlxEngine.from_path(str(tiny_model_path), EngineConfig(chunk_size_tokens=CHUNK))
    eng.start()
    yield eng
    eng.close()


def with_logprobs(params: SamplingParams, top: int = 5, prompt_top: int | None = None):
    return dataclasses.replace(params, logprobs=top, prompt_logprobs=prompt_top)


def test_tokens_do_not_change_when_logprobs_are_asked(engine) -> None:
    plain = GenerationRequest("plain", prompt(21), 12, SEEDED)
    asked = dataclasses.replace(plain, request_id="asked", sampling=with_logprobs(SEEDED, 3, 2))
    assert support.generate(engine, asked).tokens == support.generate(engine, plain).tokens
    assert all(e.logprobs is None for e in support.generate(engine, plain).events)


def test_greedy_token_leads_its_top_logprobs(engine) -> None:
    request = GenerationRequest("greedy", prompt(19, 1), 10, with_logprobs(SamplingParams()))
    events = [e for e in support.generate(engine, request).events if e.token_id is not None]
    assert events and all(e.logprobs is not None for e in events)
    for event in events:
        lp = event.logprobs
        assert lp.top_ids[0] == event.token_id and lp.top_logprobs[0] == lp.logprob
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        assert len(lp.top_ids) == 5 and lp.logprob <= 0.0


def test_prefill_and_decode_roles_report_what_hybrid_reports(engine) -> None:
    request = GenerationRequest("split", prompt(23, 2), 9, with_logprobs(SEEDED, 4, 3))
    hybrid = support.generate(engine, request).events
    first = support.prefill(engine, request)
    decoded = support.Events()
    engine.decode(request, first.first_token, first.cache, decoded)
    decoded.wait()
    assert first.logprobs == hybrid[0].logprobs
    assert first.prompt_logprobs == hybrid[0].prompt_logprobs
    assert [e.logprobs for e in decoded.events if e.token_id is not None] == [
        e.logprobs for e in hybrid[1:] if e.token_id is not None]


def test_prompt_logprobs_are_the_models_and_skip_the_prefix_cache(engine,
                                                                  tiny_model_path) -> None:
    tokens = prompt(20, 3)
    warm = GenerationRequest("warm", tokens, 1)
    support.generate(engine, warm)  # the prompt is in the prefix cache now
    asked = GenerationRequest("asked", tokens, 1, with_logprobs(SamplingParams(), 0, 2))
    first = support.generate(engine, asked).events[0]
    assert first.cached_tokens == 0  # computed, not reused
    found = first.prompt_logprobs
    assert len(found) == len(tokens) - 1 and found.top == 2
    model, _ = load_mlx_model(str(tiny_model_path))
    logits = model(mx.array(tokens, dtype=mx.uint32)[None])[0].astype(mx.float32)
    reference = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    want = reference[np.arange(len(tokens) - 1), np.array(tokens[1:])]
    np.testing.assert_allclose(found.logprobs, want, atol=2e-3)
    assert (found.top_ids[:, 0] == reference[:-1].argmax(axis=1)).all()
    # The same request again: the same numbers, bit for bit.
    again = support.generate(engine, dataclasses.replace(asked, request_id="again"))
    assert again.events[0].prompt_logprobs == found
