"""``SpeculativeBatch``: the decode batch, with proposals verified in the same step.

A step proposes for each sequence that speculates (``plan.py``) and, if any has a
proposal, runs one verify forward for the whole batch (``verify.py``): sequences
with and without proposals, and with different numbers of them, step together.
Each sequence then takes its rows in order through the engine's own sampler, so
a token is accepted exactly when the target's pick equals the proposal; the first
mismatch (or the row after the last proposal) gives the step's last token. With
sampling, drawing from the target and accepting on a match is the rejection rule
for a deterministic proposal (accept with probability p(token), else a draw from
the rest of p): the output distribution is the target's. Every token is emitted as
its own event, so streams see ordinary tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn
import numpy as np

from engines.decode_batch import DecodeBatch, Sequence
from engines.speculative.plan import SequencePlan
from engines.speculative.verify import settle_groups, supports_speculation, verify_rows
from mlxcel_plugin.speculative.settings import MethodCounts, SpeculativeConfig, SpeculativeStats

# (sequence, one logits row) -> True while the sequence goes on: samples, emits.
AdvanceOne = Callable[[Sequence, np.ndarray], bool]


class SpeculativeBatch(DecodeBatch):
    """A :class:`DecodeBatch` whose step yields up to ``1 + k`` tokens per sequence."""

    def __init__(self, model: nn.Module, config: SpeculativeConfig):
        super().__init__(model)
        self.config = config
        self.enabled = supports_speculation(model)  # else every step is a plain one
        self._plans: dict[str, SequencePlan] = {}
        self._proposals: list[list[int]] = []
        self._widths: list[int] = []
        self._tally: dict[str, MethodCounts] = {}
        self.stats = SpeculativeStats()  # replaced whole: other threads read it
        self.emitted = 0  # tokens the last step emitted

    def step_rows(self) -> list[np.ndarray]:
        """One forward; per sequence its logits rows ``[1 + k, vocab]`` (k: its proposals)."""
        sequences = self.sequences
        self._proposals = [self._propose(s) for s in sequences] if self.enabled else []
        if not any(self._proposals):
            self._proposals = [[] for _ in sequences]
            self._widths = []
            return [row[None] for row in self.step()]
        rows, self._widths = verify_rows(self.model, self._head, self._groups, self._proposals,
                                       self.before_group)
        return rows

    def _propose(self, sequence: Sequence) -> list[int]:
        plan = self._plans.get(sequence.request_id)
        if plan is None:
            plan = self._plans[sequence.request_id] = SequencePlan.for_sequence(
                sequence, self.config)
        return plan.propose(sequence) if plan.active else []

    def advance(self, rows: list[np.ndarray], advance_one: AdvanceOne) -> list[int]:
        """Take each sequence's rows in order; indices of those that go on. Settles the K/V."""
        keep, kept = [], []
        self.emitted = 0
        for i, (sequence, block, proposal) in enumerate(
                zip(self.sequences, rows, self._proposals, strict=True)):
            going, used = self._take_rows(sequence, block, proposal, advance_one)
            self.emitted += used
            kept.append(used)
            self._count(sequence, proposal, used - 1)
            if going:
                keep.append(i)
        if self._widths:
            settle_groups(self._groups, self._widths, kept)
        self._forget_finished(keep)
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

    def _forget_finished(self, keep: list[int]) -> None:
        going = {self.sequences[i].request_id for i in keep}
        self._plans = {rid: plan for rid, plan in self._plans.items() if rid in going}
        self.stats = SpeculativeStats(dict(self._tally))

    def remove(self, request_ids: set[str]) -> list[Sequence]:
        for request_id in request_ids:
            self._plans.pop(request_id, None)
        return super().remove(request_ids)
