"""DraftBatch on the tiny model: after any accepted counts, the draft proposes what a
fresh prefill of the same context proposes (its K/V was cut back and caught up right).

Several sequences share one left-padded group and accept different numbers of
proposals, so the shared trim and the roll into the padding are both exercised; a
sequence that skips steps catches up on several unseen tokens at once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engines.decode_batch import Sequence
from engines.model_loader import load_mlx_model
from engines.speculative.draft_batch import DraftBatch, prefill_draft
from mlxcel_plugin.engine_api import GenerationRequest
from tests.engines.speculative.drafts import noisy_copy

STEPS = 10


@pytest.fixture(scope="module")
def draft(tiny_model_path, tmp_path_factory):
    path = noisy_copy(tiny_model_path, tmp_path_factory.mktemp("d") / "draft")
    return load_mlx_model(path)[0]


def fresh_proposals(model, context: list[int], count: int) -> list[int]:
    """The draft's greedy continuation of ``context`` from a cache built from scratch."""
    caches = prefill_draft(model, context[:-1])
    token, out = context[-1], []
    for _ in range(count):
        logits = model(mx.array([[token]], dtype=mx.uint32), cache=caches)
        token = int(np.argmax(np.array(logits[0, -1])))
        out.append(token)
    return out


def target(name: str, prompt_len: int, seed: int) -> Sequence:
    rng = np.random.default_rng(seed)
    prompt = tuple(int(t) for t in rng.integers(100, 4000, prompt_len))
    first = int(rng.integers(100, 4000))
    return Sequence(GenerationRequest(name, prompt, 1000), None, None, first, 1, [first])


def test_proposals_after_any_acceptance_match_a_fresh_prefill(draft):
    batch = DraftBatch(draft)
    targets = {s.request_id: s for s in (target(f"s{i}", 30 + 3 * i, i) for i in range(4))}
    batch.join(list(targets.values()))
    rng = np.random.default_rng(0)
    for step in range(STEPS):
        # Sequence 3 drafts only every third step: it catches up on what it skipped.
        counts = {rid: int(rng.integers(1, 4)) for rid in targets
                  if rid != "s3" or step % 3 == 0}
        proposals = batch.propose(targets, counts, lambda rid, j, row: int(np.argmax(row)))
        accepted = {}
        for rid, sequence in targets.items():
            context = [*sequence.request.prompt_tokens, *sequence.generated]
            assert proposals[rid] == fresh_proposals(draft, context, counts.get(rid, 0)), (
                step, rid)
            taken = int(rng.integers(0, len(proposals[rid]) + 1))
            correction = int(rng.integers(100, 4000))
            sequence.generated += [*proposals[rid][:taken], correction]
            sequence.num_generated = len(sequence.generated)
            sequence.last_token = correction
            accepted[rid] = taken
        batch.settle(accepted)
        mx.eval([c.state for g in batch._groups for c in g.caches])
    assert batch.group_sizes == [4]
    batch.keep_only({"s1"})
    assert [s.request_id for s in batch.sequences] == ["s1"]
