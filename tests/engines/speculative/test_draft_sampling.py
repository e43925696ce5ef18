"""DraftVerifier on a fake 6-token model: proposals drawn from the draft's distribution and
judged by the rejection rule give tokens distributed as the engine's own sampler would
(temperature, top-p applied to the target's row), checked by chi-square (fixed seed)."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

from engines.sampling import TokenSampler
from engines.speculative.draft_sampling import DraftVerifier
from mlxcel_plugin.engine_api import SamplingParams

SAMPLES = 6000
TARGET = np.array([2.0, 1.5, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
DRAFT = np.array([0.5, 2.0, 1.0, 0.5, 0.0, 1.0], dtype=np.float32)  # disagrees on purpose


def test_verified_draws_follow_the_target_sampler():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    sampler = DraftVerifier(TokenSampler(params, (), TARGET.size))
    p = sampler.probabilities(TARGET)
    tokens, kept = [], 0
    for position in range(SAMPLES):
        proposal = sampler.propose(DRAFT, position, first=True)
        token = sampler.sample(TARGET, position)
        kept += token == proposal
        tokens.append(token)
    counts = np.bincount(tokens, minlength=TARGET.size)
    allowed = p > 0
    assert counts[~allowed].sum() == 0  # top-p's cut tokens never come out
    assert chisquare(counts[allowed], SAMPLES * p[allowed]).pvalue > 0.001
    assert 0 < kept < SAMPLES  # both branches of the rule ran


def test_rows_past_the_proposals_are_the_plain_sampler():
    params = SamplingParams(temperature=0.8, seed=3)
    plain = TokenSampler(params, (), TARGET.size)
    wrapped = DraftVerifier(TokenSampler(params, (), TARGET.size))
    assert [wrapped.sample(TARGET, i) for i in range(50)] == [plain.sample(TARGET, i)
                                                               for i in range(50)]
