"""The running decode batch: sequences join and leave between steps.

Sequences of similar length share a *group*: one left-padded sub-batch
(mlx-lm's ``BatchKVCache``: ``merge`` to build, ``extend`` to join, ``filter``
to leave). Attention in a group runs over its longest sequence, so a 2k-token
handoff joining short streams would make each of them attend (and copy) 2k
padded positions on every step; instead it opens a group of its own. A lone
sequence keeps its own per-sequence caches (no merge copy, no padding mask).
Every group's forward is built first and evaluated together, once per step;
where the model is ``head(body(x))`` the groups share one vocabulary
projection (for small models, reading ``lm_head`` is much of a step).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engines.engine_memory import model_bytes
from engines.kv_quant import mergeable
from engines.sampling import TokenSampler
from mlxcel_plugin.engine_api import EmitToken, GenerationRequest
from mlxcel_plugin.logprobs import TokenLogprobs

# A sequence joins a group while the group's longest sequence is at most this
# many times its shortest: padded attention costs at most twice the real one.
MAX_LENGTH_RATIO = 2.0
# ...or while they differ by at most this many tokens (short prompts batch together).
LENGTH_SLACK_TOKENS = 256
# Each group is one more forward per step; past this many, a sequence joins the
# group it pads least.
MAX_GROUPS = 4
# An extra forward per step costs about as much as copying this many cached
# tokens (tiny test model on CPU: ~4k; SmolLM2-135M's weights: ~9k tokens of its
# KV), or a forward's read of the weights in tokens of K/V where that is less
# (``forward_cost_tokens``). Joining a group copies the whole group's caches
# twice (``extend``, then ``filter`` when the sequence leaves), so a sequence
# with only a few tokens to go, or K/V large beside the weights (a long handoff:
# gigabytes to copy on the engine thread between two steps), opens a group of
# its own instead.
FORWARD_COST_TOKENS = 4096


@dataclass
class Sequence:
    """One request being decoded."""

    request: GenerationRequest
    emit: EmitToken
    sampler: TokenSampler
    last_token: int  # the newest token: the input of the next step
    num_generated: int  # tokens emitted so far, the first one included
    # Tokens emitted so far, kept only where a finished sequence's KV is reused.
    generated: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def take_next(self, logits: np.ndarray) -> tuple[int, TokenLogprobs | None]:
        """Sample the next token from its raw logits row and take it in; its logprobs if asked."""
        token = self.sampler.sample(logits, self.next_position)
        self.sampler.observe(token)
        self.num_generated += 1
        self.last_token = token
        self.generated.append(token)
        return token, self.sampler.logprobs(logits, token)

    @property
    def next_position(self) -> int:
        """Absolute position of the token the next step samples."""
        return len(self.request.prompt_tokens) + self.num_generated

    @property
    def steps_left(self) -> int | None:
        """Steps until ``max_tokens`` (EOS may come sooner); None when unbounded."""
        if self.request is None:
            return None
        return self.request.max_tokens - self.num_generated


def merge_caches(per_sequence: list[list[Any]]) -> list[Any]:
    """Per-layer batch caches from one cache list per sequence."""
    layers = zip(*per_sequence, strict=True)
    return [type(group[0]).merge(list(group)) for group in layers]


def cached_tokens(caches: list[Any]) -> int:
    """Positions a sequence's attention reads (rotating caches stop at their window)."""
    return int(caches[0].size())


def fits(lengths: list[int], n: int) -> bool:
    """Whether a sequence of ``n`` cached tokens may share a group holding ``lengths``."""
    lo, hi = min(*lengths, n), max(*lengths, n)
    return hi - lo <= LENGTH_SLACK_TOKENS or hi <= MAX_LENGTH_RATIO * lo


def worth_joining(lengths: list[int], n: int, steps_left: int | None,
                  forward_tokens: int = FORWARD_COST_TOKENS) -> bool:
    """Whether the copies of joining cost less than a forward of its own for ``steps_left``
    (``forward_tokens``: cached tokens whose copy costs one forward)."""
    if steps_left is None:
        return True
    copied = 2 * (len(lengths) + 1) * max(*lengths, n)
    return copied <= steps_left * forward_tokens


def forward_cost_tokens(weights_bytes: int, caches: list[Any]) -> int:
    """``FORWARD_COST_TOKENS``, or fewer: the cached tokens of these caches whose bytes match
    one forward's read of the weights, where that is less (the constant was measured on
    small models, whose forwards cost more than their weights' bytes say)."""
    # Plain K/V only: a quantized cache's keys are a (words, scales, biases) tuple.
    held = [c for c in caches if isinstance(getattr(c, "keys", None), mx.array)
            and c.keys.ndim == 4]
    per_token = sum(c.nbytes / max(1, c.keys.shape[2]) for c in held)
    if not weights_bytes or not per_token:
        return FORWARD_COST_TOKENS
    return max(1, min(FORWARD_COST_TOKENS, int(weights_bytes / per_token)))


def added_padding(lengths: list[int], n: int) -> int:
    """Padded positions a group gains when a sequence of ``n`` tokens joins it."""
    longest = max(lengths)
    return len(lengths) * max(0, n - longest) + max(0, longest - n)


Head = Callable[[mx.array], mx.array]


def vocab_head(model: nn.Module) -> Head | None:
    """The model's vocabulary projection, if its forward is exactly ``head(model.model(...))``.

    Checked on a probe (same logits, bit for bit), so an architecture that
    does more after its body (logit soft-capping, scaling) gets None.
    """
    body = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(body, "embed_tokens"):
        head = body.embed_tokens.as_linear  # tied embeddings
    if body is None or head is None:
        return None
    probe = mx.array([[1, 2, 3]], dtype=mx.uint32)
    try:
        whole = model(probe, cache=make_prompt_cache(model))
        split = head(body(probe, cache=make_prompt_cache(model)))
    except (TypeError, ValueError, AttributeError):  # a body with another signature
        return None
    same = whole.shape == split.shape and bool(mx.array_equal(whole, split).item())
    return head if same else None


@dataclass
class _Group:
    """Sequences stepped as one sub-batch.

    ``caches`` are a lone sequence's own per-layer caches until a second
    sequence joins; from then on, per-layer batch caches.
    """

    sequences: list[Sequence]
    caches: list[Any]
    lengths: list[int]  # cached tokens per sequence (what the next step attends over)
    batched: bool = False
    # The body's output for the next step, computed already (engines/sliced_join.py: the
    # K/V it wrote are in ``caches``); that step only takes its row through the shared head.
    ready: mx.array | None = None

    @classmethod
    def of(cls, joining: list[tuple[Sequence, list[Any]]]) -> _Group:
        sequence, caches = joining[0]
        group = cls([sequence], caches, [cached_tokens(caches)])
        group.join(joining[1:])
        return group

    def join(self, joining: list[tuple[Sequence, list[Any]]]) -> None:
        if not joining:
            return
        new_caches = [caches for _, caches in joining]
        if self.batched:
            for running, new in zip(self.caches, merge_caches(new_caches), strict=True):
                running.extend(new)
        else:
            self.caches = merge_caches([self.caches, *new_caches])
            self.batched = True
        self.sequences += [sequence for sequence, _ in joining]
        self.lengths += [cached_tokens(caches) for caches in new_caches]

    def keep(self, indices: list[int]) -> None:
        if len(indices) == len(self.sequences):
            return
        self.sequences = [self.sequences[i] for i in indices]
        self.lengths = [self.lengths[i] for i in indices]
        if self.batched and indices:
            for cache in self.caches:
                cache.filter(indices)

    def inputs(self) -> mx.array:
        return mx.array([s.last_token for s in self.sequences], dtype=mx.uint32)[:, None]

    def stepped(self) -> None:
        if self.ready is not None:  # its K/V were written before this step
            self.ready = None
            return
        self.lengths = [n + 1 for n in self.lengths]

    @property
    def nbytes(self) -> int:
        return int(sum(c.nbytes for c in self.caches))


def _nothing(sequences: list[Sequence]) -> None:
    return None


class DecodeBatch:
    """Sequences decoded together, one token each per :meth:`step`.

    ``sequences`` lists every group's sequences in order; ``step`` returns
    their logits rows in that order, and ``keep`` takes indices into it.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._head = vocab_head(model)
        self._weights_bytes = model_bytes(model)  # what one forward reads (``worth_joining``)
        self._groups: list[_Group] = []
        # Called with a group's sequences before its forward (engines/lora: their adapters).
        self.before_group: Callable[[list[Sequence]], None] = _nothing

    def __len__(self) -> int:
        return sum(len(g.sequences) for g in self._groups)

    @property
    def head(self) -> Head | None:
        """The vocabulary projection groups share (``vocab_head``), checked once per batch."""
        return self._head

    @property
    def sequences(self) -> list[Sequence]:
        return [s for g in self._groups for s in g.sequences]

    @property
    def group_sizes(self) -> list[int]:
        """Sequences per group, in order (how the batch is split into forwards)."""
        return [len(g.sequences) for g in self._groups]

    def add(self, sequences: list[Sequence], caches: list[list[Any]],
            ready: mx.array | None = None) -> None:
        """Join new sequences (``caches[j]`` holds sequence j's per-layer caches). ``ready``:
        one sequence's body output for its next step, already computed (a group of its own)."""
        if ready is not None:
            (sequence,), (own,) = sequences, caches
            self._groups.append(_Group([sequence], own, [cached_tokens(own)], ready=ready))
            return
        lengths = [list(g.lengths) for g in self._groups]
        joining: list[list[tuple[Sequence, list[Any]]]] = [[] for _ in self._groups]
        for sequence, own in zip(sequences, caches, strict=True):
            target = self._target_group(lengths, own, sequence.steps_left)
            if target == len(lengths):
                lengths.append([])
                joining.append([])
            lengths[target].append(cached_tokens(own))
            joining[target].append((sequence, own))
        for group, arriving in zip(self._groups, joining, strict=False):
            group.join(arriving)
        self._groups += [_Group.of(arriving) for arriving in joining[len(self._groups) :]]

    def opens_group(self, caches: list[Any], steps_left: int | None) -> bool:
        """Whether a sequence with these caches would get a forward of its own (``add``)."""
        lengths = [g.lengths for g in self._groups]
        return self._target_group(lengths, caches, steps_left) == len(lengths)

    def _target_group(self, lengths: list[list[int]], caches: list[Any],
                      steps_left: int | None) -> int:
        """The group a sequence with ``caches`` joins, given the groups' ``lengths`` (groups
        ``add`` is opening come after this batch's); ``len(lengths)``: a new one."""
        if not mergeable(caches):  # quantized K/V have no batch form: a group of its own
            return len(lengths)
        # A ready group's next step is its one row through the head: a sequence joining it
        # would get no row (the step's rows one short) and no forward for its K/V.
        closed = {i for i, g in enumerate(self._groups) if g.ready is not None}
        cost = forward_cost_tokens(self._weights_bytes, caches)
        return self._pick_group(lengths, cached_tokens(caches), steps_left, cost, closed)

    @staticmethod
    def _pick_group(lengths: list[list[int]], n: int, steps_left: int | None,
                    forward_tokens: int = FORWARD_COST_TOKENS,
                    closed: Collection[int] = ()) -> int:
        """The group a sequence of ``n`` tokens joins; ``len(lengths)``: a new one."""
        open_groups = [i for i in range(len(lengths)) if i not in closed]
        candidates = [
            i
            for i in open_groups
            if fits(lengths[i], n) and worth_joining(lengths[i], n, steps_left, forward_tokens)
        ]
        if not candidates and (len(lengths) < MAX_GROUPS or not open_groups):
            return len(lengths)
        pool = candidates or open_groups
        return min(pool, key=lambda i: added_padding(lengths[i], n))

    def keep(self, indices: list[int]) -> None:
        """Keep only the sequences at ``indices``; the others' K/V are dropped."""
        wanted, start = set(indices), 0
        for group in self._groups:
            size = len(group.sequences)
            group.keep([i - start for i in range(start, start + size) if i in wanted])
            start += size
        self._groups = [g for g in self._groups if g.sequences]

    def sequence_caches(self, index: int) -> list[Any]:
        """Per-layer caches of the sequence at ``index`` alone, unpadded (a copy if batched)."""
        for group in self._groups:
            if index < len(group.sequences):
                if not group.batched:
                    return group.caches
                return [cache.extract(index) for cache in group.caches]
            index -= len(group.sequences)
        raise IndexError(index)

    def remove(self, request_ids: set[str]) -> list[Sequence]:
        removed = [s for s in self.sequences if s.request_id in request_ids]
        if removed:
            self.keep([i for i, s in enumerate(self.sequences) if s.request_id not in request_ids])
        return removed

    def step(self) -> np.ndarray:
        """One forward for every sequence; returns float32 logits ``[B, vocab]``."""
        logits = self._forward().astype(mx.float32)
        mx.eval(logits)
        for group in self._groups:
            group.stepped()
        return np.array(logits)

    def _forward(self) -> mx.array:
        """Next-token logits of every group, in order (lazy)."""
        groups = self._groups
        if len(groups) == 1 and groups[0].ready is None:
            self.before_group(groups[0].sequences)
            return self.model(groups[0].inputs(), cache=groups[0].caches)[:, -1, :]
        if self._head is None:  # no group is ready then: sliced_join needs the head
            rows = [self._group_forward(self.model, g) for g in groups]
            return mx.concatenate(rows)
        hidden = [self._group_forward(self.model.model, g) if g.ready is None else g.ready
                  for g in groups]
        return self._head(mx.concatenate(hidden))

    def _group_forward(self, forward: Callable[..., mx.array], group: _Group) -> mx.array:
        self.before_group(group.sequences)
        return forward(group.inputs(), cache=group.caches)[:, -1, :]

    @property
    def has_ready(self) -> bool:
        """Whether a group's next step is only its head row (``add``'s ``ready``)."""
        return any(g.ready is not None for g in self._groups)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self._groups)
