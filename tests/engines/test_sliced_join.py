"""Sliced first forwards: the same logits and K/V as the whole body's step, bit for bit,
a slice of layers per call; refused where the body is not its layers in a row."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engines.decode_batch import DecodeBatch, Sequence, vocab_head
from engines.model_loader import load_mlx_model
from engines.sliced_join import LayeredBody, SlicedJoins, sliced_joins
from mlxcel_plugin.engine_api import GenerationRequest
from tests.engines.test_decode_batch import handed_off


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_mlx_model(tiny_model_path)[0]


def sequence(request_id: str, first: int) -> Sequence:
    request = GenerationRequest(request_id, (1, 2, 3), 8)
    return Sequence(request, None, None, last_token=first, num_generated=1)


def test_a_first_forward_in_slices_equals_the_whole_step_bit_for_bit(model):
    first, whole_caches = handed_off(model, 300, seed=2)
    _, sliced_caches = handed_off(model, 300, seed=2)
    whole, sliced = DecodeBatch(model), DecodeBatch(model)
    whole.add([sequence("w", first)], [whole_caches])
    joins = SlicedJoins(LayeredBody.of(model, vocab_head(model)), slices=4)
    joins.begin(sequence("s", first), sliced_caches)
    assert joins.per_slice == 1  # the tiny model's 4 layers: one a call
    calls = [joins.step({"s"}, lambda sequences: None) for _ in range(4)]
    assert [len(done) for done in calls] == [0, 0, 0, 1] and len(joins) == 0
    forward, output = calls[-1][0]
    assert forward.sequence.request_id == "s" and forward.caches is sliced_caches
    sliced.add([forward.sequence], [sliced_caches], ready=output)
    assert sliced.has_ready
    for _ in range(3):  # the ready row through the head, then plain steps: the same logits
        assert np.array_equal(sliced.step(), whole.step())
    assert not sliced.has_ready
    for a, b in zip(whole_caches, sliced_caches, strict=True):
        assert a.offset == b.offset == 303
        assert np.array_equal(np.array(a.keys[..., :303, :]), np.array(b.keys[..., :303, :]))
        assert np.array_equal(np.array(a.values[..., :303, :]), np.array(b.values[..., :303, :]))


def test_a_sequence_arriving_while_a_group_is_ready_gets_a_group_and_a_row_of_its_own(model):
    """A ready group's step is its head row only: a newcomer that joined it got no row, and the
    engine thread died on the short rows (a hybrid node under locust load)."""
    first, sliced_caches = handed_off(model, 40, seed=2)
    newcomer_first, newcomer_caches = handed_off(model, 40, seed=3)
    _, alone_caches = handed_off(model, 40, seed=3)
    joins = SlicedJoins(LayeredBody.of(model, vocab_head(model)), slices=1)
    joins.begin(sequence("s", first), sliced_caches)
    ((forward, output),) = joins.step({"s"}, lambda sequences: None)
    batch, alone = DecodeBatch(model), DecodeBatch(model)
    batch.add([forward.sequence], [sliced_caches], ready=output)
    assert batch.opens_group(newcomer_caches, 8)  # the ready group takes no one
    batch.add([sequence("n", newcomer_first)], [newcomer_caches])
    alone.add([sequence("n", newcomer_first)], [alone_caches])
    assert batch.group_sizes == [1, 1]
    rows = batch.step()
    assert rows.shape[0] == len(batch) == 2
    assert np.array_equal(rows[1:], alone.step())  # the newcomer's own forward, its own row


def test_a_cancelled_sequence_is_dropped_mid_forward(model):
    first, caches = handed_off(model, 40)
    joins = SlicedJoins(LayeredBody.of(model, vocab_head(model)))
    joins.begin(sequence("gone", first), caches)
    joins.step({"gone"}, lambda sequences: None)
    assert joins.step(set(), lambda sequences: None) == [] and len(joins) == 0


class ScaledBody(nn.Module):
    """The tiny model's body, with embeddings scaled as some architectures do (Gemma)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.embed_tokens, self.layers, self.norm = body.embed_tokens, body.layers, body.norm

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs) * 2.0
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, "causal" if h.shape[1] > 1 else None, cache=c)
        return self.norm(h)


class ScaledModel(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.lm_head = ScaledBody(model.model), model.lm_head

    @property
    def layers(self) -> list:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.lm_head(self.model(inputs, cache))


def test_a_body_that_is_more_than_its_layers_is_not_sliced(model):
    assert LayeredBody.of(model, vocab_head(model)) is not None
    scaled = ScaledModel(model)
    assert vocab_head(scaled) is not None  # head(body(x)) holds: only the body differs
    assert LayeredBody.of(scaled, vocab_head(scaled)) is None
    assert sliced_joins(scaled, DecodeBatch(scaled)) is None


def test_a_model_with_a_sliding_window_is_not_sliced(model, monkeypatch):
    monkeypatch.setattr(model.args, "sliding_window", 4096)  # as a windowed model's args say
    assert LayeredBody.of(model, vocab_head(model)) is None
    monkeypatch.setattr(model.args, "sliding_window", None)
    monkeypatch.setattr(model.args, "layer_types", ["sliding_attention", "full_attention"])
    assert LayeredBody.of(model, vocab_head(model)) is None
