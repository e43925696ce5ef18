"""How a quantized chunk splits: rows sent exact, and groups sharing a scale.

A chunk is rows of a layer tensor seen as ``[kv_heads * tokens, head_dim]``
(head-major). The first ``exact`` tokens of every head travel unquantized:
token 0 is the attention sink, off-distribution and attended by every query,
so its error reaches every output. The other rows form groups either along
head_dim within a row (``DimGroups``: values) or along tokens within one
channel of one head (``TokenGroups``: keys, whose outlier channels would set
the step of every value in a row). Token groups are aligned to the head's
token index, so a group never straddles two heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenSpan:
    """Which tokens a chunk holds: ``tokens`` per head, row 0 is token ``first``."""

    tokens: int
    first: int
    exact: int  # leading tokens of each head sent unquantized

    def positions(self, rows: int) -> np.ndarray:
        """The token index (within its head) of each row: ``(first + row) % tokens``, built
        from ranges (an integer ``%`` per row took ~3% of an int8 decode's CPU here: it
        runs per chunk and per block)."""
        first = self.first % self.tokens
        if rows <= self.tokens:  # within one head, or wrapping into the next once
            positions = np.arange(first, first + rows, dtype=np.int64)
            positions[self.tokens - first :] -= self.tokens
            return positions
        return np.resize(np.arange(self.tokens, dtype=np.int64), first + rows)[first:]

    def exact_rows(self, rows: int) -> np.ndarray:
        return self.positions(rows) < self.exact


class DimGroups:
    """Groups of ``size`` consecutive values of a row; one scale per group."""

    def __init__(self, size: int, rows: int, head_dim: int):
        self.size = size
        self.count = rows * head_dim // size

    def view(self, values: np.ndarray) -> np.ndarray:
        return values.reshape(-1, self.size)

    def reduce(self, values: np.ndarray, ufunc: np.ufunc) -> np.ndarray:
        # Over the flat values, ``reduceat`` is ~3x faster than reducing [groups, size]'s
        # short contiguous rows (measured on rows of 64).
        flat = np.ascontiguousarray(values).reshape(-1)
        if not flat.size:
            return flat.copy()
        return ufunc.reduceat(flat, np.arange(0, flat.size, self.size))

    def expand(self, per_group: np.ndarray) -> np.ndarray:
        return per_group.reshape(-1, 1)

    def apply(self, ufunc: np.ufunc, values: np.ndarray, per_group: np.ndarray,
              out: np.ndarray) -> np.ndarray:
        """``ufunc(value, its group's entry)`` into ``out`` (may be ``values``)."""
        ufunc(self.view(values), self.expand(per_group), out=self.view(out))
        return out


class TokenGroups:
    """One group per channel per run of at most ``size`` tokens of one head."""

    def __init__(self, size: int, positions: np.ndarray, head_dim: int, exact: int):
        # A run starts at every size-th token past the exact ones, and at the chunk's start.
        starts = (positions - exact) % size == 0
        if positions.size:
            starts[0] = True
        self.starts = np.flatnonzero(starts)
        self.lengths = np.diff(np.append(self.starts, positions.size))
        self.count = self.starts.size * head_dim
        self.head_dim = head_dim
        # Consecutive runs of one length: (first run, runs, length). Reducing each as a
        # [runs, length, head_dim] view is ~5x faster than ``reduceat`` (measured).
        edges = [0, *(np.flatnonzero(np.diff(self.lengths)) + 1).tolist(), self.lengths.size]
        self.segments = [(a, b - a, int(self.lengths[a]))
                         for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]

    def view(self, values: np.ndarray) -> np.ndarray:
        return values

    def reduce(self, values: np.ndarray, ufunc: np.ufunc) -> np.ndarray:
        """One row per run: ``ufunc`` over the run's rows (``values``: [rows, width])."""
        out = np.empty((self.starts.size, values.shape[1]), dtype=values.dtype)
        for first, runs, length in self.segments:
            at = int(self.starts[first])
            rows = values[at : at + runs * length].reshape(runs, length, -1)
            ufunc.reduce(rows, axis=1, out=out[first : first + runs])
        return out

    def expand(self, per_group: np.ndarray) -> np.ndarray:
        return np.repeat(per_group.reshape(-1, self.head_dim), self.lengths, axis=0)

    def apply(self, ufunc: np.ufunc, values: np.ndarray, per_group: np.ndarray,
              out: np.ndarray) -> np.ndarray:
        """``ufunc(value, its group's entry)`` into ``out`` (may be ``values``): each run of
        equal-length runs broadcast as a view, with no expanded copy of ``per_group``."""
        per_group = per_group.reshape(-1, 1, self.head_dim)
        for first, runs, length in self.segments:
            rows = slice(int(self.starts[first]), int(self.starts[first]) + runs * length)
            shape = (runs, length, self.head_dim)
            ufunc(values[rows].reshape(shape), per_group[first : first + runs],
                  out=out[rows].reshape(shape))
        return out
