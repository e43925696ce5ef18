"""Sampling: a pure function of (seed, position); filters and penalties do what they say."""

from __future__ import annotations

import numpy as np

from engines.sampling import TokenSampler, apply_penalties, position_rng, sample_from_logits
from mlxcel_plugin.engine_api import SamplingParams

VOCAB = 1000


def logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32) * 3


def test_greedy_is_argmax():
    row = logits()
    assert TokenSampler(SamplingParams(), [], VOCAB).sample(row, 5) == int(np.argmax(row))


def test_seeded_sampling_depends_only_on_seed_and_position():
    params = SamplingParams(temperature=1.0, seed=42)
    row = logits()
    a, b = TokenSampler(params, [1, 2], VOCAB), TokenSampler(params, [], VOCAB)
    draws = [a.sample(row, p) for p in range(50)]
    # A second sampler (another node) asked for the same positions in another order agrees.
    assert [b.sample(row, p) for p in reversed(range(50))] == draws[::-1]
    assert len(set(draws)) > 10


def test_position_rng_differs_by_seed_and_position():
    assert position_rng(1, 7).random() == position_rng(1, 7).random()
    assert position_rng(1, 7).random() != position_rng(1, 8).random()
    assert position_rng(1, 7).random() != position_rng(2, 7).random()
    position_rng(-1, 0).random()  # negative seeds are folded into uint64


def test_top_k_one_is_greedy():
    row = logits(3)
    params = SamplingParams(temperature=2.0, top_k=1, seed=0)
    rng = np.random.default_rng(0)
    assert {sample_from_logits(row, params, rng) for _ in range(20)} == {int(np.argmax(row))}


def test_top_p_and_min_p_restrict_the_support():
    row = logits(4)
    order = np.argsort(-row)
    rng = np.random.default_rng(0)
    top_p = SamplingParams(temperature=1.0, top_p=0.3)
    probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.3)) + 1].tolist())
    assert {sample_from_logits(row, top_p, rng) for _ in range(200)} <= nucleus
    min_p = SamplingParams(temperature=1.0, min_p=0.5)
    allowed = set(np.nonzero(probs >= 0.5 * probs.max())[0].tolist())
    assert {sample_from_logits(row, min_p, rng) for _ in range(200)} <= allowed


def test_penalties_lower_seen_tokens():
    row = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    counts = np.array([1, 1, 3, 0])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.1)
    out = apply_penalties(row, counts, params)
    assert np.allclose(out, [2.0 / 2 - 0.5 - 0.1, -2.0 * 2 - 0.5 - 0.1, 1.0 / 2 - 0.5 - 0.3, 0.5])


def test_penalty_context_grows_with_generated_tokens():
    row = np.zeros(VOCAB, dtype=np.float32)
    row[7] = 1.0
    sampler = TokenSampler(SamplingParams(presence_penalty=2.0), [1, 2], VOCAB)
    assert sampler.sample(row, 2) == 7
    sampler.observe(7)
    assert sampler.sample(row, 3) != 7
