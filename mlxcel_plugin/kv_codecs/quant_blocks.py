"""Splitting one group-quantized chunk into row blocks that encode one at a time.

Why: the key encoder makes several passes over a chunk's rows (rotation, group ranges,
codes, the rotated-error check). A whole 8 MiB chunk is 16 MiB of float32, beyond a
core's caches, so every pass went to memory; blocks stay in cache. Each block also costs
fixed work (its groups, scales and minimums: tens of NumPy calls), so blocks should not
be small: on 8B-shaped bf16 KV (head_dim 128, one x86 core with 1 MiB of L2 and a 32 MiB
L3) 2 MiB blocks encoded keys 1.2-1.5x and decoded 1.1-1.2x faster than 512 KiB blocks,
and 4 MiB gained nothing more.

A block boundary is always a group boundary of the whole chunk (and, for int4, falls
after an even number of codes), so each block encodes exactly as a chunk of its own
would, starting at that row: the chunk's body is the blocks' sections joined section by
section (exact rows, minimums, scales, codes), the same format a single pass writes.
Encoding and decoding walk the same ``blocks``; ``BlockCursor`` finds each one's sections.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator

import numpy as np

from mlxcel_plugin.kv_codecs.floats import to_float32
from mlxcel_plugin.kv_codecs.groups import DimGroups, TokenGroups
from mlxcel_plugin.kv_codecs.quant_format import ChunkFormat

BLOCK_BYTES = 2 * 1024 * 1024  # of float32 work values per block


def block_starts(fmt: ChunkFormat, rows: int, head_dim: int) -> list[int]:
    """Row offsets of the blocks (``[0]``: encode the chunk in one pass)."""
    target = max(1, BLOCK_BYTES // (4 * max(head_dim, 1)))
    if rows <= target or head_dim % 2:  # odd head_dim: int4 codes would not pack per block
        return [0]
    candidates = _group_boundaries(fmt, rows)
    starts = [0]
    while starts[-1] + target < rows:  # bounded: every round moves past a candidate
        reach = np.searchsorted(candidates, starts[-1] + target, side="right") - 1
        if reach < 0 or candidates[reach] <= starts[-1]:  # none within reach: the next one
            reach = np.searchsorted(candidates, starts[-1], side="right")
        if reach >= candidates.size:
            break
        starts.append(int(candidates[reach]))
    return starts


def cut_at(starts: list[int], fmt: ChunkFormat, rows: int, head_dim: int,
           cuts: list[int]) -> list[int] | None:
    """``starts`` with rows ``cuts`` added (where the receive buffer's pieces begin: a
    buffer with room, one piece per head), so that no block spans two pieces; None where a
    cut is not a group boundary of the chunk (or int4 codes would not pack per block)."""
    cuts = [cut for cut in cuts if 0 < cut < rows]
    if not cuts:
        return starts
    if head_dim % 2 or (fmt.along_tokens and not _group_starts(fmt, np.array(cuts)).all()):
        return None
    return sorted({*starts, *cuts})


class PieceRows:
    """Rows ``[start, stop)`` of pieces that sit back to back (``[n, width]`` each), for a
    block that lies within one piece (``cut_at``)."""

    def __init__(self, pieces: list[np.ndarray]):
        self.pieces = pieces
        self.firsts = np.cumsum([0, *(len(p) for p in pieces[:-1])]).tolist()

    def rows(self, start: int, stop: int) -> np.ndarray:
        index = bisect.bisect_right(self.firsts, start) - 1
        first = self.firsts[index]
        return self.pieces[index][start - first : stop - first]


def spanning_rows(pieces: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """The pieces as rows of one ``[n, width]`` view that starts at the first piece's first
    row, and where each of their rows lies in it; None where a piece is not C-contiguous
    rows of the first one's kind at a whole-row offset after it. The view may cover rows
    of no piece (a buffer with room: the other tokens' rows between heads): only the
    returned rows may be written."""
    first = pieces[0]
    if first.ndim != 2:
        return None
    row_bytes, at = first.shape[1] * first.itemsize, []
    for piece in pieces:
        same_kind = piece.ndim == 2 and piece.shape[1:] == first.shape[1:]
        if not (same_kind and piece.dtype == first.dtype and piece.flags.c_contiguous):
            return None
        offset, rem = divmod(piece.ctypes.data - first.ctypes.data, row_bytes)
        if rem or offset < 0:
            return None
        at.append(np.arange(offset, offset + len(piece), dtype=np.int64))
    rows = np.concatenate(at)
    span = np.lib.stride_tricks.as_strided(first, (int(rows.max(initial=-1)) + 1,
                                                   first.shape[1]), (row_bytes, first.itemsize))
    return span, rows


@dataclasses.dataclass(frozen=True)
class Block:
    """Rows ``[start, stop)`` of a chunk seen as a chunk of their own."""

    start: int
    stop: int
    fmt: ChunkFormat
    exact: np.ndarray | None  # which of the block's rows travel exact (None: none)
    groups: DimGroups | TokenGroups

    @property
    def rows(self) -> int:
        return self.stop - self.start


def blocks(fmt: ChunkFormat, rows: int, head_dim: int, starts: list[int]) -> Iterator[Block]:
    """The chunk's blocks from ``starts`` (``block_starts``), in row order."""
    for start, stop in zip(starts, [*starts[1:], rows], strict=True):
        block_fmt = shifted(fmt, start)
        yield Block(start, stop, block_fmt, *block_fmt.split(stop - start, head_dim))


def shifted(fmt: ChunkFormat, row: int) -> ChunkFormat:
    """The format of the chunk's rows from ``row`` on, seen as a chunk of their own."""
    if fmt.span is None or not row:
        return fmt
    span = dataclasses.replace(fmt.span, first=(fmt.span.first + row) % fmt.span.tokens)
    return dataclasses.replace(fmt, span=span)


def column_extent(array: np.ndarray, fmt: ChunkFormat, dtype: str) -> np.ndarray:
    """Each channel's max |x| over the chunk's quantized rows: what the rotated-error check
    of every block compares against, so blocking does not change what the check accepts."""
    exact, _ = fmt.split(*array.shape)
    values = to_float32(array[~exact] if exact is not None else array, dtype)
    return np.abs(values).max(axis=0, initial=0.0)


class BlockCursor:
    """Where the next block's exact values, groups and codes start in their sections."""

    def __init__(self) -> None:
        self.exact = self.groups = self.codes = 0

    def advance(self, block: Block, head_dim: int) -> tuple[slice, slice, slice]:
        """The block's slice of each section (exact values, minimums and scales, codes)."""
        exact_rows = int(block.exact.sum()) if block.exact is not None else 0
        sizes = (exact_rows * head_dim, block.groups.count, (block.rows - exact_rows) * head_dim)
        parts = tuple(slice(at, at + size) for at, size in
                      zip((self.exact, self.groups, self.codes), sizes, strict=True))
        self.exact, self.groups, self.codes = (part.stop for part in parts)
        return parts


def place_rows(
    out: np.ndarray, exact: np.ndarray | None, exact_values: np.ndarray, decoded: np.ndarray
) -> None:
    """Write one block's rows into ``out``: exact rows as they came, the others decoded
    (``decoded``: any array that casts into ``out``'s dtype, ``rounded_for_storage``).

    Run by run (a head's first tokens are exact, the rest not): slices copy several times
    faster than a boolean mask scatters; the cast happens in the same pass as the copy."""
    decoded = decoded.reshape(-1, out.shape[1])
    if exact is None:
        np.copyto(out, decoded, casting="unsafe")
        return
    sources = (decoded, exact_values.reshape(-1, out.shape[1]))
    used = [0, 0]
    for begin, end in _runs(exact):
        kind = int(exact[begin])
        source = sources[kind][used[kind] : used[kind] + end - begin]
        np.copyto(out[begin:end], source, casting="unsafe")
        used[kind] += end - begin


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``[begin, end)`` of each run of equal values of ``mask``."""
    edges = [0, *(np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist(), mask.size]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _group_boundaries(fmt: ChunkFormat, rows: int) -> np.ndarray:
    """Rows (ascending, past 0) where a group of the whole chunk starts."""
    if not fmt.along_tokens:  # groups within a row: any row starts one
        return np.arange(1, rows)
    starts = _group_starts(fmt, np.arange(rows))
    starts[0] = False
    return np.flatnonzero(starts)


def _group_starts(fmt: ChunkFormat, rows: np.ndarray) -> np.ndarray:
    """Whether a group of the whole chunk (token groups) starts at each of ``rows``."""
    span = fmt.span
    positions = (span.first + rows) % span.tokens
    past_exact = positions - span.exact
    return (positions == 0) | ((past_exact >= 0) & (past_exact % fmt.group == 0))
