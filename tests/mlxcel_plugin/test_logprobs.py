"""Logprobs: the numbers (raw log-softmax), their order, and their wire forms."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel_plugin.engine_api import SamplingParams
from mlxcel_plugin.logprobs import (
    LogprobsMalformed,
    PromptLogprobs,
    TokenLogprobs,
    logprob_rows,
    token_logprobs,
    tokens_from_wire,
    tokens_to_wire,
)


def reference(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_a_rows_logprobs_are_its_log_softmax() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 1000)) * 4).astype(np.float32)
    found = logprob_rows(logits, [5, 17, 999], 4)
    for i, token in enumerate([5, 17, 999]):
        want = reference(logits[i])
        assert found.logprobs[i] == pytest.approx(want[token], abs=1e-5)
        best = np.argsort(-want, kind="stable")[:4]
        assert found.top_ids[i].tolist() == best.tolist()
        np.testing.assert_allclose(found.top_logprobs[i], want[best], atol=1e-5)


def test_ties_rank_the_lower_id_first_and_top_0_reports_the_token_alone() -> None:
    row = np.zeros(10, np.float32)
    row[[7, 3]] = 2.0
    assert token_logprobs(row, 7, 3).top_ids == (3, 7, 0)
    alone = token_logprobs(row, 7, 0)
    assert alone.top_ids == () and alone.logprob == pytest.approx(reference(row)[7], abs=1e-6)


def test_token_logprobs_travel_exactly() -> None:
    item = token_logprobs(np.linspace(-3, 3, 50, dtype=np.float32), 9, 3)
    assert tokens_from_wire(tokens_to_wire([item, item]), 2) == (item, item)
    assert tokens_from_wire(None, 4) == ()


@pytest.mark.parametrize("wire", [
    [[0.5, [], []]],  # a positive logprob
    [[-1.0, [1], []]],  # lists of two lengths
    [[-1.0, [True], [-1.0]]],  # not a token id
    [[-1.0, [], []], [-1.0, [], []]],  # more entries than tokens
    [["x", [], []]],
])
def test_malformed_token_logprobs_are_refused(wire) -> None:
    with pytest.raises(LogprobsMalformed):
        tokens_from_wire(wire, 1)


def test_prompt_logprobs_body_round_trips_and_is_checked() -> None:
    rng = np.random.default_rng(1)
    found = logprob_rows(rng.standard_normal((6, 300)).astype(np.float32), [1, 2, 3, 4, 5, 6], 2)
    assert PromptLogprobs.from_body(found.to_body(), 2) == found
    assert found.token(1) == TokenLogprobs(float(found.logprobs[1]),
                                           tuple(found.top_ids[1].tolist()),
                                           tuple(found.top_logprobs[1].tolist()))
    with pytest.raises(LogprobsMalformed):
        PromptLogprobs.from_body(found.to_body()[:-1], 2)
    with pytest.raises(LogprobsMalformed):
        PromptLogprobs.from_body(np.ones(3, np.float32).tobytes(), 0)  # positive


def test_sampling_params_leave_logprobs_out_of_their_dict_unless_asked() -> None:
    assert "logprobs" not in SamplingParams().to_dict()
    asked = SamplingParams(logprobs=2, prompt_logprobs=0)
    assert SamplingParams.from_dict(asked.to_dict()) == asked


@pytest.mark.parametrize("scale,top", [(0.01, 20), (1.0, 5), (30.0, 20), (1.0, 1)])
def test_top_ids_are_exactly_a_full_sorts(scale: float, top: int) -> None:
    rng = np.random.default_rng(int(scale * 100) + top)
    rows = (rng.standard_normal((4, 5000)) * scale).astype(np.float32)
    rows[1] = np.round(rows[1] * 2) / 2  # many ties at the cut
    found = logprob_rows(rows, [0, 1, 2, 3], top)
    for row, ids in zip(rows, found.top_ids, strict=True):
        want = np.lexsort((np.arange(row.size), -row))[:top]
        assert ids.tolist() == want.tolist()
