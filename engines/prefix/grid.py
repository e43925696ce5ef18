"""Where a prefill splits its forwards, and which cached prefixes it can resume from exactly.

Float rounding depends on the shape of the work, so a prompt's K/V are the
same bits on a cache hit as without the cache only if the hit recomputes the
rest with forwards the cache-off run's numbers do not notice. The grid is a
row of *cells* of ``cell`` tokens from position 0 (``[engine]
chunk_size_tokens``); ``run_prefill`` never lets a forward cross a cell's end
and computes the last token alone.

Two granularities (docs/prefix-cache.md):

* **whole cells** (``min_rows`` None): a forward's rounding depends on its
  rows, so only whole cells are the same whatever else was computed; a hit
  resumes at a cell's start.
* **any token** (``min_rows`` set): where ``engines/prefix/reuse_probe.py`` found
  at start-up that a forward of at least ``min_rows`` rows gives each row the
  bits a whole cell gives it (keys padded to the cell's end,
  ``engines/prefix/padded_keys.py``), a hit resumes at any position that leaves its
  first forward ``min_rows`` rows, and a prompt's partial last cell is kept.

Pure arithmetic on token counts: no MLX here.
"""

from __future__ import annotations

from dataclasses import dataclass

Span = tuple[int, int]  # [start, end) of one forward


@dataclass(frozen=True)
class PrefillGrid:
    cell: int
    min_rows: int | None = None  # None: reuse whole cells only

    def __post_init__(self) -> None:
        if self.cell < 1:
            raise ValueError(f"chunk_size_tokens must be >= 1, got {self.cell}")

    @property
    def any_token(self) -> bool:
        return self.min_rows is not None

    def cell_start(self, position: int) -> int:
        return position // self.cell * self.cell

    def cell_end(self, position: int) -> int:
        """The end of the cell holding ``position``: keys are padded up to it."""
        return self.cell_start(position) + self.cell

    def forwards(self, start: int, total: int) -> list[Span]:
        """The forwards computing ``tokens[start:total]``: cells, the rest but one, the last."""
        if not 0 <= start < total:
            raise ValueError(f"cannot prefill from {start} of {total} tokens")
        spans = []
        position = start
        while position < total - 1:
            end = min(self.cell_end(position), total - 1)
            spans.append((position, end))
            position = end
        spans.append((total - 1, total))
        return spans

    def full_cells_end(self, total: int) -> int:
        """Tokens of a ``total``-token prompt that lie in whole cells before its last token."""
        return self.cell_start(total - 1) if total > 0 else 0

    def exact_end(self, total: int) -> int:
        """How many of a prefilled prompt's tokens any longer prompt's prefill computes the same.

        Whole cells always; with ``min_rows``, also the partial last cell when its
        forward had enough rows. Never the last token (a one-row forward).
        """
        full = self.full_cells_end(total)
        if self.min_rows is not None and total - 1 - full >= self.min_rows:
            return total - 1
        return full

    def usable(self, held: int, total: int) -> int:
        """The longest prefix of at most ``held`` tokens a ``total``-token prompt resumes after.

        ``held`` cached tokens must be exact (``exact_end`` of what stored them).
        """
        resume = min(held, total - 1)
        if resume <= 0:
            return 0
        start = self.cell_start(resume)
        if self.min_rows is None or resume == start:
            return min(start, self.full_cells_end(total))
        first_end = min(self.cell_end(resume), total - 1)
        if first_end - resume >= self.min_rows:
            return resume
        # Back off so the first forward has min_rows rows; else resume at the cell's start.
        return max(start, first_end - self.min_rows)
