"""``SpeculativeBatch``: the decode batch, with proposals verified in the same step.

A step asks each speculating sequence how many tokens it would propose (its adaptive
controller, ``plan.py``); each batch group then verifies no deeper than its extra rows
pay for (``mlxcel_plugin/speculative/group_rule.py``). Prompt lookup proposes from
the sequence's own context; a draft model proposes for every drafting sequence in one
batched draft forward per token (``draft_batch.py``). If any sequence has a proposal,
one verify forward runs for the whole batch (``verify.py``): sequences with and
without proposals, and with different numbers of them, step together. Each sequence
then takes its rows in order through the engine's own sampler, so a token is accepted
exactly when the target's pick equals the proposal; the first mismatch (or the row
after the last proposal) gives the step's last token. With sampling, a deterministic
proposal (n-gram, or a greedy draft) is kept with probability p(token), else the row
is a draw from the rest of p: the rejection rule for a point-mass proposal; a sampled
draft's proposals go through the general rule (``draft_sampling.py``). Either way the
output distribution is the target's. Every token is emitted as its own event.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engines.decode_batch import DecodeBatch, Sequence
from engines.speculative.draft_batch import DraftBatch
from engines.speculative.draft_load import load_draft
from engines.speculative.draft_sampling import choose_proposal, wrap_sampled
from engines.speculative.plan import SequencePlan
from engines.speculative.verify import settle_groups, supports_speculation, verify_rows
from mlxcel_plugin.engine_api import ModelInfo
from mlxcel_plugin.speculative.group_rule import capped, group_width
from mlxcel_plugin.speculative.settings import MethodCounts, SpeculativeConfig, SpeculativeStats
from mlxcel_plugin.speculative.step_cost import StepCost

# (sequence, one logits row) -> True while the sequence goes on: samples, emits.
AdvanceOne = Callable[[Sequence, np.ndarray], bool]


class SpeculativeBatch(DecodeBatch):
    """A :class:`DecodeBatch` whose step yields up to ``1 + k`` tokens per sequence."""

    def __init__(self, model: nn.Module, config: SpeculativeConfig,
                 target: ModelInfo | None = None):
        super().__init__(model)
        self.config = config
        self.enabled = supports_speculation(model)  # else every step is a plain one
        # The draft's tokenizer is checked against the target's (``target.tokenizer_dir``).
        draft = load_draft(target.tokenizer_dir, config) if self.enabled and target else None
        self._draft = DraftBatch(draft) if draft is not None else None
        self._plans: dict[str, SequencePlan] = {}
        self._ngram: dict[str, list[int]] = {}  # this step's prompt-lookup proposals
        self._proposals: list[list[int]] = []
        self._widths: list[int] = []
        self._drafted = False  # the draft proposed this step: its K/V to settle
        self._tally: dict[str, MethodCounts] = {}
        self.cost = StepCost(config.verify_row_cost, config.learn_row_cost)  # rows, timed
        self.stats = SpeculativeStats()  # replaced whole: other threads read it
        self.emitted = 0  # tokens the last step emitted

    def add(self, sequences: list[Sequence], caches: list[list[Any]],
            ready: mx.array | None = None) -> None:
        super().add(sequences, caches, ready)
        has_draft = self._draft is not None
        for sequence in sequences:
            plan = SequencePlan.for_sequence(sequence, self.config, has_draft)
            self._plans[sequence.request_id] = plan
            if plan.drafts:
                wrap_sampled(sequence)
        drafting = [s for s in sequences if self._plans[s.request_id].drafts]
        if drafting:
            self._draft.join(drafting)

    def keep(self, indices: list[int]) -> None:
        going = {self.sequences[i].request_id for i in indices}
        super().keep(indices)
        self._plans = {rid: plan for rid, plan in self._plans.items() if rid in going}
        if self._draft is not None:
            self._draft.keep_only(going)

    @property
    def drafts(self) -> bool:
        """Whether a draft model proposes (it joins a sequence on its context so far)."""
        return self._draft is not None

    @property
    def nbytes(self) -> int:
        """K/V held, the draft's included (the engine's KV budget counts both)."""
        return super().nbytes + (self._draft.nbytes if self._draft is not None else 0)

    def step_rows(self) -> list[np.ndarray]:
        """One forward; per sequence its logits rows ``[1 + k, vocab]`` (k: its proposals)."""
        sequences = self.sequences
        speculate = self.enabled and not self.has_ready  # a ready group: no verify forward
        counts = self._group_caps(self._offers(sequences)) if speculate else []
        self._proposals = self._fill(sequences, counts) if any(counts) else []
        if not any(self._proposals):
            self._proposals = [[] for _ in sequences]
            self._widths = []
            return [row[None] for row in self.step()]
        # Only verify forwards are timed: they run the BLAS on one thread (verify.py), plain
        # steps at its own count, another curve that a line through both would mix up.
        started = time.perf_counter()
        rows, self._widths = verify_rows(self.model, self._head, self._groups, self._proposals,
                                         self.before_group)
        fed = sum(n * w for n, w in zip(self.group_sizes, self._widths, strict=True))
        self.cost.record(fed, time.perf_counter() - started)
        return rows

    def _offers(self, sequences: list[Sequence]) -> list[int]:
        """Tokens each sequence would verify this step (prompt lookup's found already)."""
        self._ngram, counts, row_cost = {}, [], self.cost.row_cost
        for sequence in sequences:
            plan = self._plans[sequence.request_id]
            plan.controller.row_cost = row_cost
            if plan.drafts or not plan.active:
                counts.append(plan.limit(sequence))
                continue
            most = plan.most(sequence)  # the n-gram's size, once found, decides how many
            found = self._propose(sequence, plan, most) if most else []
            self._ngram[sequence.request_id] = found
            counts.append(len(found))
        return counts

    def _propose(self, sequence: Sequence, plan: SequencePlan, limit: int) -> list[int]:
        return plan.ngram_proposals(sequence, limit)

    def _group_caps(self, counts: list[int]) -> list[int]:
        """Each group verifies no deeper than pays for its rows (the adaptive rule, batched)."""
        if not self.config.adaptive or not any(counts):
            return counts
        caps, start = [], 0
        for size in self.group_sizes:
            mine = counts[start : start + size]
            if size == 1:  # alone: its own rule, whose probes are how it learns its rate
                caps += mine
            else:
                rates = [self._plans[s.request_id].controller.rate
                         for s in self.sequences[start : start + size]]
                caps += capped(mine, group_width(rates, mine, self.cost.row_cost))
            start += size
        return caps

    def _fill(self, sequences: list[Sequence], counts: list[int]) -> list[list[int]]:
        """Each sequence's proposals, ``counts[i]`` of them (the draft's drawn now)."""
        drafting = {s.request_id: n for s, n in zip(sequences, counts, strict=True)
                    if n and self._plans[s.request_id].drafts}
        drafted: dict[str, list[int]] = {}
        self._drafted = bool(drafting)
        if drafting:
            targets = {s.request_id: s for s in sequences}
            drafted = self._draft.propose(targets, drafting, lambda rid, j, row: choose_proposal(
                targets[rid], j, row))
        return [drafted.get(s.request_id) or self._ngram.get(s.request_id, [])[:n]
                for s, n in zip(sequences, counts, strict=True)]

    def advance(self, rows: list[np.ndarray], advance_one: AdvanceOne) -> list[int]:
        """Take each sequence's rows in order; indices of those that go on. Settles the K/V."""
        keep, kept, accepted = [], [], {}
        self.emitted = 0
        for i, (sequence, block, proposal) in enumerate(
                zip(self.sequences, rows, self._proposals, strict=True)):
            going, used = self._take_rows(sequence, block, proposal, advance_one)
            self.emitted += used
            kept.append(used)
            accepted[sequence.request_id] = used - 1
            self._count(sequence, proposal, used - 1)
            if going:
                keep.append(i)
        if self._widths:
            settle_groups(self._groups, self._widths, kept)
        if self._drafted:
            self._draft.settle(accepted)
            self._drafted = False
        self.stats = SpeculativeStats(dict(self._tally))
        return keep

    @staticmethod
    def _take_rows(sequence: Sequence, block: np.ndarray, proposal: list[int],
                   advance_one: AdvanceOne) -> tuple[bool, int]:
        """(goes on, rows used): row j's token is accepted when it equals ``proposal[j]``."""
        for j, row in enumerate(block):
            if not advance_one(sequence, row):
                return False, j + 1
            if j == len(proposal) or sequence.last_token != proposal[j]:
                return True, j + 1
        raise AssertionError("unreachable: the row after the last proposal always stops")

    def _count(self, sequence: Sequence, proposal: list[int], accepted: int) -> None:
        if not proposal:
            return
        plan = self._plans[sequence.request_id]
        plan.controller.observe(len(proposal), accepted)
        was = self._tally.get(plan.method, MethodCounts())
        self._tally[plan.method] = MethodCounts(was.proposed + len(proposal),
                                                was.accepted + accepted, was.verify_steps + 1)
