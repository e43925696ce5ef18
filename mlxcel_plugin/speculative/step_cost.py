"""What one more verified row costs on this node, learned from the forwards it times.

The adaptive rules (``adaptive.py``, ``group_rule.py``) weigh a forward of ``r`` rows as
``1 + row_cost * (r - 1)`` one-row forwards. On a GPU a few more rows cost almost
nothing; on a CPU (OpenBLAS) a forward of 5 rows measured 1.1-2.2x a one-row step,
shifting with the machine's load. So a node times its verify forwards (``n * w`` rows
for ``n`` sequences at width ``w``), keeps a decayed mean time per row count, and fits
``time = fixed + per_row * rows``: ``row_cost = per_row / (fixed + per_row)``, the cost
of one more row as a fraction of a one-row forward on that line. Plain steps are not
timed: a verify runs the BLAS on one thread, a plain step at the library's own count,
and a line through both curves mixed them (after a 1-stream run, 4-row plain steps
slowed by OpenBLAS's threads read as dear verify rows and stopped 4-stream speculation).
Weighing a plain step as the line's one-row forward is conservative where one thread
is faster (here under load: 167 against 227 ms). Until two row counts have been timed a
few times each, the configured ``verify_row_cost`` stands. Pure: the caller passes the
seconds it measured.

A tensor-parallel follower rank must propose exactly what its leader does (every rank
runs the same forwards): it learns nothing itself and takes the leader's cost after each
step (``follow``; engines/sharding/).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Old timings weigh this much less at each new one of the same row count.
DECAY = 0.8
# Timings of a row count before its mean is trusted.
MIN_SAMPLES = 3
# A fit past this is noise from a loaded machine (one row dearer than four forwards).
MAX_ROW_COST = 4.0


@dataclass
class _Bucket:
    mean_s: float = 0.0
    samples: int = 0

    def add(self, seconds: float) -> None:
        weight = 1.0 if self.samples == 0 else 1.0 - DECAY
        self.mean_s += weight * (seconds - self.mean_s)
        self.samples += 1


@dataclass
class StepCost:
    """Decode forwards timed per row count, and the per-row cost they imply."""

    prior_row_cost: float  # ``[speculative] verify_row_cost``: until timings say otherwise
    learn: bool = True
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _leader_row_cost: float | None = None  # a follower rank's: what its leader uses

    def follow(self, leader_row_cost: float) -> None:
        """From now on the cost is the leader's (a follower rank; it times nothing)."""
        self.learn = False
        self._leader_row_cost = leader_row_cost

    def record(self, rows: int, seconds: float) -> None:
        """One forward of ``rows`` rows (all groups of a step) took ``seconds``."""
        if self.learn and rows > 0 and seconds > 0:
            self._buckets.setdefault(rows, _Bucket()).add(seconds)

    @property
    def samples(self) -> dict[int, int]:
        """Forwards timed so far, per row count."""
        return {rows: b.samples for rows, b in sorted(self._buckets.items())}

    @property
    def row_cost(self) -> float:
        """One more row, as a fraction of a one-row forward."""
        if self._leader_row_cost is not None:
            return self._leader_row_cost
        fit = self._fit()
        if fit is None:
            return self.prior_row_cost
        fixed_s, per_row_s = fit
        one_row_s = fixed_s + per_row_s
        if one_row_s <= 0:
            return MAX_ROW_COST
        return min(MAX_ROW_COST, max(0.0, per_row_s / one_row_s))

    def _fit(self) -> tuple[float, float] | None:
        """Least squares ``time = fixed + per_row * rows`` over the trusted row counts."""
        points = [(rows, b.mean_s) for rows, b in self._buckets.items()
                  if b.samples >= MIN_SAMPLES]
        if len(points) < 2:
            return None
        mean_r = sum(r for r, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        spread = sum((r - mean_r) ** 2 for r, _ in points)
        per_row = sum((r - mean_r) * (t - mean_t) for r, t in points) / spread
        return mean_t - per_row * mean_r, per_row
