"""The batch times its forwards and proposes by what a verified row costs on this node.

Tiny model; the proposals are the target's own next tokens (every one accepted), fed
through the real prompt-lookup path, so how many are proposed is the adaptive rule's
choice alone: many where a row is cheap, few where the timings say it is dear.
"""

from __future__ import annotations

import pytest

from engines.model_loader import load_mlx_model
from engines.speculative.batch import SpeculativeBatch
from mlxcel_plugin.speculative.settings import SpeculativeConfig
from mlxcel_plugin.speculative.step_cost import MIN_SAMPLES
from tests.engines.speculative.test_speculative_batch import alone, greedy, sequence
from tests.engines.test_decode_batch import prefilled

STEPS = 16


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_mlx_model(tiny_model_path)[0]


class TruthIndex:
    """A prompt-lookup index whose every lookup is a 4-gram match of the true next tokens."""

    def __init__(self, truth: list[int], seq):
        self.truth, self.seq = truth, seq

    def __len__(self) -> int:
        return len(self.seq.request.prompt_tokens) + len(self.seq.generated)

    def extend(self, tokens) -> None:
        return None

    def lookup(self, limit: int) -> tuple[int, list[int]]:
        return 4, self.truth[self.seq.num_generated :][:limit]


def run(model, timings: dict[int, float] | None) -> SpeculativeBatch:
    truth = alone(model, 30, 0)
    first, caches = prefilled(model, 30, 0)
    batch = SpeculativeBatch(model, SpeculativeConfig(method="ngram", verify_row_cost=0.1))
    seq = sequence("s", 30, first)
    batch.add([seq], [caches])
    batch._plans["s"].index = TruthIndex(truth, seq)
    for rows, seconds in (timings or {}).items():
        for _ in range(MIN_SAMPLES):
            batch.cost.record(rows, seconds)
    batch.cost.learn = timings is None  # given timings stand: this machine's would blur them
    while seq.num_generated <= STEPS:
        batch.advance(batch.step_rows(), greedy)
    assert seq.generated[: STEPS + 1] == truth[: STEPS + 1]  # the tokens never change
    return batch


def test_verify_forwards_are_timed_by_the_rows_they_fed(model):
    batch = run(model, None)
    proposed = batch.stats.methods["ngram"]
    assert proposed.accepted == proposed.proposed > 0
    # Verify steps of 1 + k rows (k grows as proposals keep being accepted); plain steps,
    # at the BLAS's own thread count, are not on the verify's line and are not timed.
    assert sum(batch.cost.samples.values()) == proposed.verify_steps
    assert min(batch.cost.samples) >= 2 and max(batch.cost.samples) == 5


def test_dear_rows_propose_less_than_cheap_ones(model):
    cheap = run(model, {1: 0.010, 5: 0.011})  # 4 more rows cost 10% more
    dear = run(model, {1: 0.010, 5: 0.090})  # ...or 9x: a row costs 2 one-row forwards
    assert cheap.cost.row_cost < 0.05 and dear.cost.row_cost > 1.0
    cheap_n, dear_n = (b.stats.methods["ngram"] for b in (cheap, dear))
    assert cheap_n.proposed / cheap_n.verify_steps == pytest.approx(4, abs=0.6)
    # Dear rows never pay, however many are accepted: only the back-off's probes remain.
    assert dear_n.proposed == dear_n.verify_steps < STEPS / 3


class NoMatch(TruthIndex):
    def lookup(self, limit: int) -> tuple[int, list[int]]:
        return 0, []


def test_plain_steps_are_not_timed(model):
    """A plain step runs the BLAS at its own thread count, a verify on one: not one line."""
    first, caches = prefilled(model, 30, 0)
    batch = SpeculativeBatch(model, SpeculativeConfig(method="ngram"))
    seq = sequence("s", 30, first)
    batch.add([seq], [caches])
    batch._plans["s"].index = NoMatch([], seq)
    for _ in range(4):
        batch.advance(batch.step_rows(), greedy)
    assert seq.num_generated == 5 and batch.cost.samples == {}
