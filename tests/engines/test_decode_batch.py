"""DecodeBatch: length groups (who shares a padded sub-batch), and tokens independent of them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engines import kv_convert
from engines.decode_batch import DecodeBatch, Sequence, vocab_head
from engines.model_loader import load_mlx_model
from engines.prefill import run_prefill


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_mlx_model(tiny_model_path)[0]


def prefilled(model, n: int, seed: int = 0) -> tuple[int, list]:
    """First greedy token and the per-layer caches of an ``n``-token prompt."""
    caches = make_prompt_cache(model)
    tokens = [(7 * j + 31 * seed) % 4000 + 100 for j in range(n)]
    logits = run_prefill(model, tokens, caches, 512)
    return int(np.argmax(np.array(logits))), caches


def handed_off(model, n: int, seed: int = 0) -> tuple[int, list]:
    """As a decode node gets it: rebuilt from the exported (sliced) layers."""
    first, caches = prefilled(model, n, seed)
    return first, kv_convert.from_cache_state(kv_convert.to_cache_state(caches))


def seq(first: int) -> Sequence:
    return Sequence(None, None, None, last_token=first, num_generated=1)


def greedy_steps(batch: DecodeBatch, steps: int) -> list[list[int]]:
    """Greedy tokens per sequence (in batch order) over ``steps`` steps."""
    out: list[list[int]] = [[] for _ in batch.sequences]
    for _ in range(steps):
        for i, (s, row) in enumerate(zip(batch.sequences, batch.step(), strict=True)):
            s.last_token = int(np.argmax(row))
            out[i].append(s.last_token)
    return out


def alone(model, first: int, caches: list, steps: int) -> list[int]:
    batch = DecodeBatch(model)
    batch.add([seq(first)], [caches])
    return greedy_steps(batch, steps)[0]


def test_similar_lengths_share_one_group(model):
    batch = DecodeBatch(model)
    joining = [prefilled(model, n, seed) for seed, n in enumerate((30, 40, 200))]
    batch.add([seq(f) for f, _ in joining], [c for _, c in joining])
    assert batch.group_sizes == [3]


def test_a_long_handoff_opens_its_own_group_and_leaves_the_others_untouched(model):
    shorts = [prefilled(model, 32, seed) for seed in range(3)]
    long_first, long_caches = handed_off(model, 1500, seed=9)
    expected = [alone(model, *prefilled(model, 32, seed), 8) for seed in range(3)]
    expected.append(alone(model, *handed_off(model, 1500, seed=9), 6))

    batch = DecodeBatch(model)
    batch.add([seq(f) for f, _ in shorts], [c for _, c in shorts])
    first_tokens = greedy_steps(batch, 2)
    batch.add([seq(long_first)], [long_caches])
    assert batch.group_sizes == [3, 1]
    rest = greedy_steps(batch, 6)
    assert [a + b for a, b in zip(first_tokens, rest[:3], strict=True)] == expected[:3]
    assert rest[3] == expected[3]


def test_keep_drops_a_finished_group_and_keeps_the_order(model):
    batch = DecodeBatch(model)
    joining = [prefilled(model, 32, 0), prefilled(model, 1500, 1), prefilled(model, 40, 2)]
    sequences = [seq(f) for f, _ in joining]
    batch.add(sequences, [c for _, c in joining])
    assert batch.group_sizes == [2, 1]
    assert batch.sequences == [sequences[0], sequences[2], sequences[1]]
    batch.keep([0, 1])  # the long one ends
    assert batch.group_sizes == [2]
    batch.step()
    assert len(batch) == 2


def test_a_fifth_length_joins_the_group_it_pads_least(model, monkeypatch):
    monkeypatch.setattr("engines.decode_batch.MAX_GROUPS", 2)
    batch = DecodeBatch(model)
    joining = [prefilled(model, n, seed) for seed, n in enumerate((20, 1000, 300))]
    batch.add([seq(f) for f, _ in joining], [c for _, c in joining])
    assert batch.group_sizes == [2, 1]  # 300 pads the 20-token group less than the 1000 one


class ScaledLogits(nn.Module):
    """A model whose forward does more than ``lm_head(model(...))``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.model, self.lm_head, self.layers = inner.model, inner.lm_head, inner.layers

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.lm_head(self.model(inputs, cache)) * 0.5


def test_groups_share_the_vocab_head_only_where_the_forward_is_exactly_body_then_head(model):
    assert vocab_head(model) is model.lm_head
    assert vocab_head(ScaledLogits(model)) is None


def test_a_sequence_about_to_end_does_not_copy_a_group_to_join_it(model):
    from mlxcel_plugin.engine_api import GenerationRequest

    def with_budget(first: int, max_tokens: int) -> Sequence:
        request = GenerationRequest(f"r{max_tokens}", (1, 2, 3), max_tokens)
        return Sequence(request, None, None, last_token=first, num_generated=1)

    batch = DecodeBatch(model)
    running = [prefilled(model, 1200, seed) for seed in range(4)]
    batch.add([seq(f) for f, _ in running], [c for _, c in running])
    last_step_first, last_step = prefilled(model, 2000, 7)
    batch.add([with_budget(last_step_first, 2)], [last_step])  # one step to go
    assert batch.group_sizes == [4, 1]
    staying_first, staying = prefilled(model, 1300, 8)
    batch.add([with_budget(staying_first, 500)], [staying])
    assert batch.group_sizes == [5, 1]


def test_kv_large_beside_the_weights_opens_a_group_instead_of_being_copied_in(model):
    """Joining copies the group's caches; where a token's K/V are large beside what a forward
    reads (an 8B-shaped KV on a narrow body, a long handoff), a group of its own is cheaper."""
    from mlx_lm.models.cache import QuantizedKVCache

    from engines.decode_batch import forward_cost_tokens
    from mlxcel_plugin.engine_api import GenerationRequest

    def with_budget(first: int, max_tokens: int) -> Sequence:
        request = GenerationRequest(f"r{max_tokens}", (1, 2, 3), max_tokens)
        return Sequence(request, None, None, last_token=first, num_generated=1)

    running = [prefilled(model, 1200, seed) for seed in range(2)]
    per_token = sum(c.nbytes / c.keys.shape[2] for c in running[0][1])
    assert forward_cost_tokens(int(per_token * 10), running[0][1]) == 10
    assert forward_cost_tokens(0, running[0][1]) == 4096  # the weights unknown
    quantized = QuantizedKVCache(group_size=32, bits=8)  # its keys are a tuple of arrays
    quantized.keys = quantized.values = (mx.zeros((1, 2, 8, 4), dtype=mx.uint32),
                                         mx.zeros((1, 2, 8, 1)), mx.zeros((1, 2, 8, 1)))
    assert forward_cost_tokens(int(per_token * 10), [quantized]) == 4096
    joining_first, joining = prefilled(model, 1300, 8)
    expected = alone(model, *prefilled(model, 1300, 8), 4)
    batch = DecodeBatch(model)
    batch._weights_bytes = int(per_token * 10)  # a forward reads what 10 tokens' K/V hold
    batch.add([with_budget(f, 500) for f, _ in running], [c for _, c in running])
    batch.add([with_budget(joining_first, 500)], [joining])
    assert batch.group_sizes == [2, 1]
    assert greedy_steps(batch, 4)[2] == expected  # the same tokens as decoding alone
