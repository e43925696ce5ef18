"""At start-up: may the prefix cache reuse any prefilled token, or only whole cells?

Whether a position's K/V come out the same bits however its cell was split
into forwards is a property of the kernels, not of the model code: with
OpenBLAS's Haswell kernels a row's rounding depends on the rows around it;
with its SkylakeX kernels and with MLX's reference BLAS it does not once a
forward has enough rows (and keys are padded to the cell's end,
engines/prefix/padded_keys.py); Metal chooses its tiles by shape. So the engine
measures it on its own model before serving: a prompt of a few cells is
computed whole, then each cell again as two forwards whose second has
``rows`` rows; the smallest ``rows`` for which every layer's K/V match bit
for bit in every cell checked becomes the grid's ``min_rows``. None (whole
cells only) when none matches, as with plain mlx-lm on the Haswell kernels.

Cells are checked at the start and at a few depths (the kernels switch paths
with the key count, and small products take other paths than large ones);
it costs about ten cells of prefill, once per machine, model and settings: the
answer is kept on disk (engines/prefix/probe_cache.py).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from engines.prefix import probe_cache
from engines.prefix.cache import cacheable, reading
from engines.prefix.grid import PrefillGrid
from engines.prefix.padded_keys import padded
from mlxcel_plugin.engine_api import EngineConfig, ModelInfo

log = logging.getLogger(__name__)

ROWS_TRIED = (8, 16, 32, 64)
CELLS = 4  # the probe prompt's length in cells; checked: the last, the second, the first
PROBE_SEED = 17


def prefill_grid(model: nn.Module, config: EngineConfig, info: ModelInfo) -> PrefillGrid:
    """The grid every prefill of this engine uses, probed (or remembered) unless ``"chunk"``."""
    whole_cells = PrefillGrid(config.chunk_size_tokens)
    if config.prefix_cache.granularity == "chunk" or config.kv_bits:
        return whole_cells
    key = probe_cache.probe_key(config, info, {"rows": ROWS_TRIED, "cells": CELLS,
                                               "seed": PROBE_SEED})
    rows = probe_cache.remembered(
        key, lambda: probe_min_rows(model, config.chunk_size_tokens, info.vocab_size))
    return whole_cells if rows is None else PrefillGrid(config.chunk_size_tokens, rows)


def probe_min_rows(model: nn.Module, cell: int, vocab_size: int) -> int | None:
    """The fewest rows a forward needs for any-token reuse to be exact; None: whole cells only."""
    if not cacheable(make_prompt_cache(model)):
        return None  # caches that cannot be cut back keep whole-cell snapshots
    rng = random.Random(PROBE_SEED)
    tokens = mx.array([rng.randrange(vocab_size) for _ in range(CELLS * cell)], mx.uint32)[None]
    grid = PrefillGrid(cell, min_rows=1)  # padded keys, as any-token prefills run
    whole = _forward_cells(model, tokens, grid, [(i * cell, (i + 1) * cell) for i in range(CELLS)])
    for rows in (r for r in ROWS_TRIED if r < cell):
        if all(_split_matches(model, tokens, grid, whole, first, rows)
               for first in (CELLS - 1, 1, 0)):
            log.info("prefix cache: any prompt token reusable (forwards of >= %d rows are exact)",
                     rows)
            return rows
    log.info("prefix cache: whole %d-token chunks reusable (this backend rounds by shape)", cell)
    return None


def _split_matches(model: nn.Module, tokens: mx.array, grid: PrefillGrid, whole: list[Any],
                   cell_index: int, rows: int) -> bool:
    start, end = cell_index * grid.cell, (cell_index + 1) * grid.cell
    caches = reading(whole, start)  # never written: extending copies
    split = _forward_cells(model, tokens, grid, [(start, end - rows), (end - rows, end)], caches)
    return all(_same_bits(a, b, start, end) for a, b in zip(whole, split, strict=True))


def _forward_cells(model: nn.Module, tokens: mx.array, grid: PrefillGrid,
                   spans: list[tuple[int, int]], caches: list[Any] | None = None) -> list[Any]:
    caches = make_prompt_cache(model) if caches is None else caches
    for begin, end in spans:
        model(tokens[:, begin:end], cache=padded(caches, grid.cell_end(begin)))
        mx.eval([c.state for c in caches])
    return caches


def _same_bits(a: Any, b: Any, start: int, end: int) -> bool:
    same = mx.array_equal(a.keys[..., start:end, :], b.keys[..., start:end, :])
    return bool(same and mx.array_equal(a.values[..., start:end, :], b.values[..., start:end, :]))
