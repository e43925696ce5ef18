"""The verify forward of a decode step, and dropping the K/V of rejected proposals.

Each sequence feeds its newest token and its proposals as one row block; a group's
sequences are padded to the group's widest block (pad rows are never read: their
K/V goes with the rejected). Groups are those of ``engines/decode_batch.py``: a
lone sequence's own ``KVCache`` list (trimmed from the right), or left-padded
``BatchKVCache`` layers, where sequences keep different numbers of rows: the
shared surplus is trimmed and each sequence's own is rolled into its left padding
(as mlx-lm's ``BatchKVCache.finalize`` does for right-padded prompts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, dynamic_roll, make_prompt_cache

from mlxcel_plugin.openblas import mlx_blas_threads

PAD_TOKEN = 0
# OpenBLAS threads for a verify forward. Its products have a few rows each (1 + k per
# sequence): memory-bound like a one-row step, where splitting them buys little and
# every split waits for the slowest worker; on cores shared with other work a worker is
# often descheduled. SmolLM2-135M, 1.5k context, 2 cores at load ~10: 5 rows took
# 1195 ms with OpenBLAS's 2 threads, 245 ms with 1 (a one-row step: 227 ms).
VERIFY_BLAS_THREADS = 1


def supports_speculation(model: nn.Module) -> bool:
    """Whether every layer's cache can drop rejected rows (plain K/V caches only)."""
    return all(type(cache) is KVCache for cache in make_prompt_cache(model))


def row_blocks(last_tokens: Sequence[int], proposals: Sequence[list[int]]) -> mx.array:
    """``[B, W]`` inputs: each sequence's newest token and proposals, right-padded."""
    width = 1 + max(len(p) for p in proposals)
    rows = [[last, *p] + [PAD_TOKEN] * (width - 1 - len(p))
            for last, p in zip(last_tokens, proposals, strict=True)]
    return mx.array(rows, dtype=mx.uint32)


def verify_rows(model: nn.Module, head: Callable | None, groups: list[Any],
                proposals: list[list[int]],
                before_group: Callable[[list[Any]], None] | None = None,
                ) -> tuple[list[np.ndarray], list[int]]:
    """One forward for every group: per sequence (batch order) float32 logits ``[1 + k, V]``,
    and each group's width (rows fed per sequence)."""
    outputs, widths, start = [], [], 0
    for group in groups:
        mine = proposals[start : start + len(group.sequences)]
        start += len(group.sequences)
        inputs = row_blocks([s.last_token for s in group.sequences], mine)
        if before_group is not None:  # DecodeBatch.before_group: the rows' adapters
            before_group(group.sequences)
        out = model(inputs, cache=group.caches) if head is None else model.model(
            inputs, cache=group.caches)
        outputs.append(out.reshape(-1, out.shape[-1]))
        widths.append(inputs.shape[1])
    flat = mx.concatenate(outputs) if len(outputs) > 1 else outputs[0]
    # Only the rows a sequence verifies reach the vocabulary projection (not the padding).
    flat = flat[mx.array(verified_rows(widths, [len(p) for p in proposals], groups))]
    logits = (flat if head is None else head(flat)).astype(mx.float32)
    with mlx_blas_threads(VERIFY_BLAS_THREADS):
        mx.eval(logits)
    table = np.array(logits)
    ends = np.cumsum([1 + len(p) for p in proposals])
    return [table[end - 1 - len(p) : end] for end, p in zip(ends, proposals, strict=True)], widths


def verified_rows(widths: list[int], counts: list[int], groups: list[Any]) -> list[int]:
    """Flat indices of each sequence's newest-token row and its ``counts[i]`` proposal rows."""
    rows, offset, i = [], 0, 0
    for group, width in zip(groups, widths, strict=True):
        for _ in group.sequences:
            rows += range(offset, offset + 1 + counts[i])
            offset, i = offset + width, i + 1
    return rows


def settle_groups(groups: list[Any], widths: list[int], kept: list[int]) -> None:
    """After a verify forward of ``widths[g]`` rows per group: sequence i keeps ``kept[i]``."""
    start = 0
    for group, width in zip(groups, widths, strict=True):
        mine = kept[start : start + len(group.sequences)]
        start += len(group.sequences)
        drop_rows(group, [width - n for n in mine])
        group.lengths = [n + k for n, k in zip(group.lengths, mine, strict=True)]


def drop_rows(group: Any, surplus: list[int]) -> None:
    """Drop sequence i's last ``surplus[i]`` cached rows (its lengths are the caller's)."""
    if group.batched:
        _drop_batched(group.caches, surplus)
    elif surplus[0]:
        for cache in group.caches:
            cache.trim(surplus[0])


def _drop_batched(caches: list[Any], surplus: list[int]) -> None:
    """Drop each sequence's last ``surplus[i]`` rows from left-padded batch caches."""
    shared = min(surplus)
    own = [n - shared for n in surplus]
    for cache in caches:
        if shared:
            cache.trim(shared)
        if any(own):
            _roll_into_padding(cache, own)


def _roll_into_padding(cache: Any, own: list[int]) -> None:
    """Rotate each row's last ``own[i]`` positions to its front, where padding is masked."""
    shifts = mx.array(own)
    end = cache._idx  # mlx-lm keeps the filled length here
    for name in ("keys", "values"):
        buffer = getattr(cache, name)
        buffer[..., :end, :] = dynamic_roll(buffer[..., :end, :], shifts[:, None], axis=2)
    cache.left_padding = cache.left_padding + shifts
    cache.offset = cache.offset - shifts
