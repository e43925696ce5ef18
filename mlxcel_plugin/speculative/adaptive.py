"""Per sequence: how many tokens to propose, from its acceptance so far.

With a per-token acceptance rate ``a`` and ``k`` proposals, a verify step yields
``(1 - a**(k+1)) / (1 - a)`` tokens on average and costs ``1 + row_cost * k`` plain
steps; the controller picks the ``k`` that yields the most tokens per cost, and 0
(a plain step) when no ``k`` beats one token per step. Switched off, it probes again
after a back-off that doubles each time a probe fails. Each kind of proposal (for
prompt lookup: the matched n-gram's size) keeps its own rate and back-off. Pure: no
clock, no RNG; the cost of a row is the caller's (``step_cost.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Old verify steps weigh this much less each step: the rate follows what the text does now.
DECAY = 0.8
# The rate a sequence starts from (as if one of two proposals had been accepted).
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0
FIRST_BACKOFF_STEPS, MAX_BACKOFF_STEPS = 4, 64
# Speculation must promise this many times a plain step's tokens per cost: the row cost is a
# line fitted to a loaded CPU's timings, and a verify step pays what it does not count (the
# lookup, the gather of verified rows). Without it, 1-proposal probes of chat's 1-gram matches
# (7% accepted, rows costing 0.03 of a step) ran at every step: 0.96x plain.
MIN_GAIN = 1.1


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verify step of ``k`` proposals yields on average (the last row's included)."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def best_k(rate: float, k_max: int, row_cost: float) -> int:
    """The proposal count with the most expected tokens per unit of step cost (0: none, also
    when the best gains less than ``MIN_GAIN`` over a plain step)."""
    def speed(k: int) -> float:
        return expected_tokens(rate, k) / (1.0 + row_cost * k)

    best = max(range(k_max + 1), key=lambda k: (speed(k), -k))
    return best if speed(best) >= MIN_GAIN else 0


@dataclass
class _Trials:
    """Decayed accept/reject counts of one kind of proposal, and its on/off state."""

    accepted: float = PRIOR_ACCEPTED
    trials: float = PRIOR_TRIALS
    backoff_steps: int = FIRST_BACKOFF_STEPS
    off_steps_left: int = 0


@dataclass
class AdaptiveController:
    """One sequence's acceptance, per kind of proposal, and its on/off state.

    A kind is what a proposal's quality depends on: for prompt lookup the size of the
    matched n-gram (on SmolLM2's code edits 1-gram matches were accepted 20%, 4-gram
    matches 81%), so a short match proposes less, or nothing, while long ones propose
    the most; a draft's proposals are all kind 0. ``proposal_limit(kind)`` makes
    ``kind`` this step's: ``rate`` and ``observe`` apply to it.
    """

    k_max: int
    row_cost: float
    adaptive: bool = True
    kind: int = 0  # this step's kind of proposal
    _kinds: dict[int, _Trials] = field(default_factory=dict)

    @property
    def _now(self) -> _Trials:
        return self._kinds.setdefault(self.kind, _Trials())

    @property
    def rate(self) -> float:
        return self._now.accepted / self._now.trials

    @property
    def off_steps_left(self) -> int:
        return self._now.off_steps_left

    def proposal_limit(self, kind: int = 0) -> int:
        """Tokens to propose this step (called once per step that could propose)."""
        self.kind = kind
        if not self.adaptive:
            return self.k_max
        now = self._now
        if now.off_steps_left > 0:
            now.off_steps_left -= 1
            return 0
        return max(1, best_k(self.rate, self.k_max, self.row_cost))  # on: at least a probe

    def observe(self, proposed: int, accepted: int) -> None:
        """This step's outcome: ``accepted`` of ``proposed`` tokens were the target's."""
        if proposed <= 0:
            return
        now = self._now
        rejected = 1 if accepted < proposed else 0  # verification stops at the first miss
        now.accepted = DECAY * now.accepted + accepted
        now.trials = DECAY * now.trials + accepted + rejected
        if not self.adaptive:
            return
        if best_k(self.rate, self.k_max, self.row_cost) == 0:
            now.off_steps_left = now.backoff_steps
            now.backoff_steps = min(2 * now.backoff_steps, MAX_BACKOFF_STEPS)
        elif accepted:
            now.backoff_steps = FIRST_BACKOFF_STEPS
