"""The rejection rule keeps the target's distribution, whatever the draft proposes from.

Statistical on purpose (the rule is randomized): a fixed seed, bounded samples, and a
chi-square test whose threshold a wrong rule (keeping every proposal, or resampling
from p instead of the residual) fails by far.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from mlxcel_plugin.speculative.rejection import residual, verify_proposal

SAMPLES = 20_000
P = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])  # the target (one token it never picks)
DRAFTS = {
    "close": np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.05]),
    "far": np.array([0.05, 0.05, 0.1, 0.2, 0.3, 0.3]),
    "point": np.array([0.0, 0.0, 0.0, 1.0, 0.0, 0.0]),  # a deterministic proposal
}


def outputs(p: np.ndarray, q: np.ndarray, rule, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = [rule(p, q, int(rng.choice(q.size, p=q)), rng) for _ in range(SAMPLES)]
    return np.bincount(tokens, minlength=p.size)


def fits_target(counts: np.ndarray, p: np.ndarray) -> bool:
    seen = p > 0
    assert counts[~seen].sum() == 0  # never a token the target rules out
    return chisquare(counts[seen], SAMPLES * p[seen]).pvalue > 0.001


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_the_rule_gives_the_target_distribution(draft):
    assert fits_target(outputs(P, DRAFTS[draft], verify_proposal), P)


def test_wrong_rules_fail_the_same_check():
    def keep_all(p, q, proposal, rng):
        return proposal

    def resample_from_p(p, q, proposal, rng):
        if rng.random() * q[proposal] < p[proposal]:
            return proposal
        return int(rng.choice(p.size, p=p))

    with pytest.raises(AssertionError):  # keeps the draft's token 5, which p rules out
        fits_target(outputs(P, DRAFTS["close"], keep_all), P)
    assert not fits_target(outputs(P, DRAFTS["far"], resample_from_p), P)


def test_a_rejected_proposal_is_never_the_row_token():
    q = DRAFTS["far"]
    rest = residual(P, q)
    assert rest[4] == 0 and rest[3] == 0  # q >= p there: the residual excludes them
    rng = np.random.default_rng(3)
    for _ in range(500):
        token = verify_proposal(P, q, 4, rng)
        assert token == 4 or rest[token] > 0
