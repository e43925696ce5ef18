"""A long handed-off sequence's first forward, run a few layers per decode step.

Why: a handoff joining a running batch opens a group of its own (its prompt is far
longer than the running streams'), and that group's first forward cost about one
more plain step (a body forward, plus attention over the whole prompt), so every
running stream had one gap per handoff about twice a plain step: the gaps that set
bench_decode_isolation's p99. Cut into ``JOIN_SLICES`` slices of the model's layers,
one slice after each step, the same work adds a quarter of that to four gaps
instead. The last slice's output joins the batch (``DecodeBatch.add``'s ``ready``):
the step after takes its row through the batch's shared vocabulary head, so no
slice reads the head's weights on its own (for small models, half a step). The
joining sequence's own second token comes ``JOIN_SLICES`` steps later than it
would have.

Only where it changes nothing: the body must be ``norm(layers(embed(tokens)))`` for
one token (checked bit for bit on a probe, like ``decode_batch.vocab_head``), no
layer may attend through a sliding window (the probe is too short to see its
mask), and the sequence's caches plain ``KVCache`` layers, one per layer (not
quantized, not nested). The slices are the very layer calls the body makes, on the same arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engines.decode_batch import Head, Sequence

# A joining sequence's first forward is spread over this many steps.
JOIN_SLICES = 4


class LayeredBody:
    """``model.model`` for one token, a range of its layers at a time."""

    def __init__(self, body: nn.Module, head: Head):
        self._body, self._head = body, head
        self.layers = len(body.layers)

    @classmethod
    def of(cls, model: nn.Module, head: Head | None) -> LayeredBody | None:
        """The layered body, if it gives the whole body's logits bit for bit on a probe."""
        body = getattr(model, "model", None)
        parts = ("embed_tokens", "layers", "norm")
        if head is None or body is None or not all(hasattr(body, p) for p in parts):
            return None
        if windowed(model):  # a window's mask differs only past the window: the probe is short
            return None
        layered = cls(body, head)
        try:
            same = layered._matches_on_probe(model)
        except (TypeError, ValueError, AttributeError):  # a layer with another signature
            return None
        return layered if same else None

    def _matches_on_probe(self, model: nn.Module) -> bool:
        prompt, token = mx.array([[1, 2, 3]], dtype=mx.uint32), mx.array([[4]], dtype=mx.uint32)
        whole_cache, layered_cache = make_prompt_cache(model), make_prompt_cache(model)
        if not plain_layers(whole_cache, self.layers):
            return False
        body = self._body
        body(prompt, cache=whole_cache)
        body(prompt, cache=layered_cache)
        whole = self._head(body(token, cache=whole_cache))[:, -1, :]
        hidden = self.run(self.embed(token), layered_cache, 0, self.layers)
        layered = self._head(self.output(hidden))
        return whole.shape == layered.shape and bool(mx.array_equal(whole, layered).item())

    def embed(self, tokens: mx.array) -> mx.array:
        return self._body.embed_tokens(tokens)

    def run(self, hidden: mx.array, caches: list[Any], start: int, stop: int) -> mx.array:
        """Layers ``[start, stop)`` over ``hidden`` (one token: no mask), writing its K/V."""
        for i in range(start, stop):
            hidden = self._body.layers[i](hidden, None, cache=caches[i])
        return hidden

    def output(self, hidden: mx.array) -> mx.array:
        """What the body returns for the token's position (the batch's head takes it)."""
        return self._body.norm(hidden)[:, -1, :]


def windowed(model: nn.Module) -> bool:
    """Whether some layer attends through a sliding window (its one-token mask is not None
    once the cache is past the window, so the layered body's None would differ)."""
    args = getattr(model, "args", None)
    settings = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    layer_types = settings.get("layer_types") or ()
    return any(v for k, v in settings.items() if "window" in k) or any(
        "sliding" in str(t) for t in layer_types
    )


def plain_layers(caches: list[Any], layers: int) -> bool:
    """One plain ``KVCache`` per layer: what the layered body writes into."""
    return len(caches) == layers and all(type(c) is KVCache for c in caches)


@dataclass
class FirstForward:
    """A sequence whose first forward is under way: layers below ``next_layer`` are done."""

    sequence: Sequence
    caches: list[Any]
    hidden: mx.array
    next_layer: int = 0


def sliced_joins(model: nn.Module, batch: Any) -> SlicedJoins | None:
    """For ``batch`` (a decode batch), where its model's body allows it and no draft model
    proposes (a draft joins a sequence on its context: it would have to catch up)."""
    if getattr(batch, "drafts", False):
        return None
    body = LayeredBody.of(model, batch.head)  # the batch checked it (two forwards) already
    return SlicedJoins(body) if body is not None else None


class SlicedJoins:
    """Sequences whose first forward runs a slice of layers per step (engine thread)."""

    def __init__(self, body: LayeredBody, slices: int = JOIN_SLICES):
        self.body = body
        self.per_slice = max(1, math.ceil(body.layers / slices))
        self._running: dict[str, FirstForward] = {}
        self.begun = 0  # first forwards sliced so far

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._running

    def __len__(self) -> int:
        return len(self._running)

    def takes(self, caches: list[Any]) -> bool:
        return plain_layers(caches, self.body.layers)

    def begin(self, sequence: Sequence, caches: list[Any]) -> None:
        tokens = mx.array([[sequence.last_token]], dtype=mx.uint32)
        self.begun += 1
        self._running[sequence.request_id] = FirstForward(sequence, caches, self.body.embed(tokens))

    def step(
        self, present: set[str], before: Callable[[list[Sequence]], None]
    ) -> list[tuple[FirstForward, mx.array]]:
        """One slice for each sequence still ``present`` (others were cancelled); those whose
        last slice ran, with the body's output for their token (evaluated)."""
        self._running = {rid: f for rid, f in self._running.items() if rid in present}
        finished: list[tuple[FirstForward, mx.array]] = []
        for forward in self._running.values():
            before([forward.sequence])  # engines/lora: its adapter, as for its group
            stop = min(self.body.layers, forward.next_layer + self.per_slice)
            forward.hidden = self.body.run(forward.hidden, forward.caches, forward.next_layer, stop)
            forward.next_layer = stop
            if stop == self.body.layers:
                finished.append((forward, self.body.output(forward.hidden)))
        mx.eval([f.hidden for f in self._running.values()], [out for _, out in finished])
        for forward, _ in finished:
            del self._running[forward.sequence.request_id]
        return finished
