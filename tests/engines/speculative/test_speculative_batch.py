"""SpeculativeBatch on the tiny model: verified proposals leave every sequence's K/V exact.

Proposals are scripted from each sequence's own plain greedy run, so a step accepts
all, some or none of them by construction; in one batched group (different accepted
counts, a sequence without proposals beside them) every sequence must still produce
the tokens it produces alone. A wrong trim or roll of the K/V shows as different tokens
on the following steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from engines.decode_batch import DecodeBatch, Sequence
from engines.model_loader import load_mlx_model
from engines.speculative.batch import SpeculativeBatch
from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.speculative.settings import SpeculativeConfig
from tests.engines.test_decode_batch import prefilled

STEPS = 24


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_mlx_model(tiny_model_path)[0]


def sequence(name: str, prompt_len: int, first: int) -> Sequence:
    request = GenerationRequest(name, tuple(range(prompt_len)), 1000)
    return Sequence(request, None, None, last_token=first, num_generated=1, generated=[first])


def alone(model, n: int, seed: int) -> list[int]:
    """The first token and STEPS greedy tokens of one sequence decoded by itself, plainly."""
    first, caches = prefilled(model, n, seed)
    batch = DecodeBatch(model)
    batch.add([sequence("ref", n, first)], [caches])
    tokens = [first]
    for _ in range(STEPS):
        batch.sequences[0].last_token = int(np.argmax(batch.step()[0]))
        tokens.append(batch.sequences[0].last_token)
    return tokens


def greedy(sequence: Sequence, row: np.ndarray) -> bool:
    token = int(np.argmax(row))
    sequence.last_token, sequence.num_generated = token, sequence.num_generated + 1
    sequence.generated.append(token)
    return True


class ScriptedBatch(SpeculativeBatch):
    """Proposals from a script: (sequence) -> tokens."""

    def __init__(self, model, script):
        # Not adaptive: every scripted proposal is verified, whatever the group's cost.
        super().__init__(model, SpeculativeConfig(method="ngram", adaptive=False))
        self.script = script

    def _propose(self, sequence: Sequence, plan, limit: int) -> list[int]:
        return self.script(sequence)


def scripts(references: dict[str, list[int]]):
    """right: the true next 3; wrong: 3 misses; half: 1 right then misses; none: nothing."""
    def script(sequence: Sequence) -> list[int]:
        truth = references[sequence.request_id][sequence.num_generated:][:3]
        kind = sequence.request_id.split("-")[0]
        if kind == "right":
            return truth
        if kind == "wrong":
            return [t + 1 for t in truth]
        if kind == "half":
            return truth[:1] + [t + 1 for t in truth[1:]]
        return []
    return script


CASES = [("right-a", 30, 0), ("wrong-b", 40, 1), ("half-c", 36, 2), ("none-d", 33, 3)]


@pytest.mark.parametrize("batched", [True, False], ids=["one-group", "lone-each"])
def test_verified_steps_give_each_sequence_its_plain_greedy_tokens(model, batched):
    references = {name: alone(model, n, seed) for name, n, seed in CASES}
    cases = CASES if batched else CASES[2:3]  # a lone sequence trims its own caches
    batch = ScriptedBatch(model, scripts(references))
    joining = [(name, n, *prefilled(model, n, seed)) for name, n, seed in cases]
    batch.add([sequence(name, n, first) for name, n, first, _ in joining],
              [caches for *_, caches in joining])
    assert batch.group_sizes == [len(cases)]
    while min(s.num_generated for s in batch.sequences) <= STEPS:
        rows = batch.step_rows()
        assert batch.advance(rows, greedy) == list(range(len(cases)))
    for s in batch.sequences:
        assert s.generated[: STEPS + 1] == references[s.request_id], s.request_id
    counts = batch.stats.methods["ngram"]
    assert 0 < counts.accepted < counts.proposed


def test_a_step_accepts_exactly_the_matching_prefix(model):
    references = {name: alone(model, n, seed) for name, n, seed in CASES}
    batch = ScriptedBatch(model, scripts(references))
    joining = [(name, n, *prefilled(model, n, seed)) for name, n, seed in CASES]
    batch.add([sequence(name, n, first) for name, n, first, _ in joining],
              [caches for *_, caches in joining])
    batch.advance(batch.step_rows(), greedy)
    # right: 3 accepted + the next; wrong: the target's own; half: 1 + the correction; none: 1.
    assert [s.num_generated for s in batch.sequences] == [5, 2, 3, 2]
    assert batch.emitted == 4 + 1 + 2 + 1
    assert batch.stats.methods["ngram"].accepted == 3 + 0 + 1
