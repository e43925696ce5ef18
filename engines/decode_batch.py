"""The running decode batch: sequences join and leave between steps.

Per-sequence caches (from a local prefill or rebuilt from a handoff) are merged
with mlx-lm's ``BatchKVCache.merge`` (left-padded) and appended with
``extend``; finished or cancelled sequences leave with ``filter``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engines.sampling import TokenSampler
from mlxcel_plugin.engine_api import EmitToken, GenerationRequest


@dataclass
class Sequence:
    """One request being decoded."""

    request: GenerationRequest
    emit: EmitToken
    sampler: TokenSampler
    last_token: int  # the newest token: the input of the next step
    num_generated: int  # tokens emitted so far, the first one included

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def next_position(self) -> int:
        """Absolute position of the token the next step samples."""
        return len(self.request.prompt_tokens) + self.num_generated


def merge_caches(per_sequence: list[list[Any]]) -> list[Any]:
    """Per-layer batch caches from one cache list per sequence."""
    layers = zip(*per_sequence, strict=True)
    return [type(group[0]).merge(list(group)) for group in layers]


class DecodeBatch:
    """Sequences decoded together, one token each per :meth:`step`."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.sequences: list[Sequence] = []
        self._caches: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, sequences: list[Sequence], caches: list[list[Any]]) -> None:
        """Join new sequences (``caches[j]`` holds sequence j's per-layer caches)."""
        merged = merge_caches(caches)
        if self._caches is None:
            self._caches = merged
        else:
            for running, new in zip(self._caches, merged, strict=True):
                running.extend(new)
        self.sequences.extend(sequences)

    def keep(self, indices: list[int]) -> None:
        """Keep only the sequences at ``indices``; the others' K/V are dropped."""
        if len(indices) == len(self.sequences):
            return
        self.sequences = [self.sequences[i] for i in indices]
        if not indices or self._caches is None:
            self._caches = None
            return
        for cache in self._caches:
            cache.filter(indices)

    def remove(self, request_ids: set[str]) -> list[Sequence]:
        removed = [s for s in self.sequences if s.request_id in request_ids]
        if removed:
            self.keep([i for i, s in enumerate(self.sequences) if s.request_id not in request_ids])
        return removed

    def step(self) -> np.ndarray:
        """One forward for every sequence; returns float32 logits ``[B, vocab]``."""
        inputs = mx.array([s.last_token for s in self.sequences], dtype=mx.uint32)[:, None]
        logits = self.model(inputs, cache=self._caches)[:, -1, :].astype(mx.float32)
        mx.eval(logits)
        return np.array(logits)

    @property
    def nbytes(self) -> int:
        if self._caches is None:
            return 0
        return int(sum(c.nbytes for c in self._caches))
