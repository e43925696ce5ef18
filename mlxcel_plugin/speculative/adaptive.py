"""Per sequence: how many tokens to propose, from its acceptance so far.

With a per-token acceptance rate ``a`` and ``k`` proposals, a verify step yields
``(1 - a**(k+1)) / (1 - a)`` tokens on average and costs ``1 + row_cost * k`` plain
steps; the controller picks the ``k`` that yields the most tokens per cost, and 0
(a plain step) when no ``k`` beats one token per step. Switched off, it probes again
after a back-off that doubles each time a probe fails. Pure: no clock, no RNG, so
every node holding the same tokens makes the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass

# Old verify steps weigh this much less each step: the rate follows what the text does now.
DECAY = 0.8
# The rate a sequence starts from (as if one of two proposals had been accepted).
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0
FIRST_BACKOFF_STEPS, MAX_BACKOFF_STEPS = 4, 64


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verify step of ``k`` proposals yields on average (the last row's included)."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def best_k(rate: float, k_max: int, row_cost: float) -> int:
    """The proposal count with the most expected tokens per unit of step cost (0: none)."""
    def speed(k: int) -> float:
        return expected_tokens(rate, k) / (1.0 + row_cost * k)

    return max(range(k_max + 1), key=lambda k: (speed(k), -k))


@dataclass
class AdaptiveController:
    """One sequence's acceptance and its on/off state."""

    k_max: int
    row_cost: float
    adaptive: bool = True
    accepted: float = PRIOR_ACCEPTED  # decayed counts of the accept/reject trials
    trials: float = PRIOR_TRIALS
    backoff_steps: int = FIRST_BACKOFF_STEPS
    off_steps_left: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.trials

    def proposal_limit(self) -> int:
        """Tokens to propose this step (called once per step)."""
        if not self.adaptive:
            return self.k_max
        if self.off_steps_left > 0:
            self.off_steps_left -= 1
            return 0
        return max(1, best_k(self.rate, self.k_max, self.row_cost))  # on: at least a probe

    def observe(self, proposed: int, accepted: int) -> None:
        """A verify step's outcome: ``accepted`` of ``proposed`` tokens were the target's."""
        if proposed <= 0:
            return
        rejected = 1 if accepted < proposed else 0  # verification stops at the first miss
        self.accepted = DECAY * self.accepted + accepted
        self.trials = DECAY * self.trials + accepted + rejected
        if not self.adaptive:
            return
        if best_k(self.rate, self.k_max, self.row_cost) == 0:
            self.off_steps_left = self.backoff_steps
            self.backoff_steps = min(2 * self.backoff_steps, MAX_BACKOFF_STEPS)
        elif accepted:
            self.backoff_steps = FIRST_BACKOFF_STEPS
