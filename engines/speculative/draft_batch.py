"""The draft model's own decode batch, beside the target's (``method = "draft"``).

Every drafting sequence keeps the draft's K/V of its context (prompt + generated) in
a :class:`DecodeBatch` of the draft model, so a step drafts for all of them in one
batched draft forward per proposed token. A sequence joining is prefilled on the
draft from its tokens (on a decode node too: the draft is small, the handoff carries
the target's K/V only). After verification each sequence's draft K/V is cut back to
what the target accepted (mlx-lm's ``trim`` on a lone cache; on left-padded batch
caches the rows roll into the padding, as for the target: ``verify.drop_rows``).
Tokens the draft has not seen yet (the target's correction, or every token of the
steps a sequence did not draft) are fed at the start of its next draft step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engines.decode_batch import DecodeBatch, Sequence
from engines.speculative.verify import drop_rows, settle_groups, verify_rows

PREFILL_CHUNK_TOKENS = 512
# (request id, proposal index, the draft's logits row) -> the proposed token.
Choose = Callable[[str, int, np.ndarray], int]


def prefill_draft(model: nn.Module, tokens: list[int] | tuple[int, ...],
                  body_only: bool = False) -> list[Any]:
    """The draft's per-layer caches after ``tokens`` (in chunks, as mlx-lm prefills).

    ``body_only``: run ``model.model`` (no vocabulary projection: only the K/V is kept),
    where the model is ``head(model.model(...))`` (``decode_batch.vocab_head``).
    """
    caches = make_prompt_cache(model)
    forward = model.model if body_only else model
    for start in range(0, len(tokens), PREFILL_CHUNK_TOKENS):
        forward(mx.array(tokens[start : start + PREFILL_CHUNK_TOKENS])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def unseen(sequence: Sequence, cached: int) -> list[int]:
    """The sequence's context (prompt + generated) from position ``cached`` on."""
    prompt = sequence.request.prompt_tokens
    if cached >= len(prompt):
        return list(sequence.generated[cached - len(prompt) :])
    return [*prompt[cached:], *sequence.generated]


class DraftBatch(DecodeBatch):
    """The draft's K/V of every drafting sequence; ``propose`` then ``settle`` each step."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self._cached: dict[str, int] = {}  # context tokens in the draft's cache, per request
        self._round: dict[str, int] = {}  # context length when the last draft step began
        self._depth = 0  # proposals the last draft step made per sequence

    def join(self, sequences: list[Sequence]) -> None:
        """Prefill the draft on each sequence's context but its newest token; add them."""
        own, caches = [], []
        for sequence in sequences:
            context = unseen(sequence, 0)
            caches.append(prefill_draft(self.model, context[:-1], self._head is not None))
            own.append(Sequence(sequence.request, None, None, context[-1], 0))
            self._cached[sequence.request_id] = len(context) - 1
        self.add(own, caches)

    def keep_only(self, request_ids: set[str]) -> None:
        self.keep([i for i, s in enumerate(self.sequences) if s.request_id in request_ids])
        self._cached = {rid: n for rid, n in self._cached.items() if rid in request_ids}

    def propose(self, targets: dict[str, Sequence], counts: dict[str, int],
                choose: Choose) -> dict[str, list[int]]:
        """Up to ``counts[rid]`` draft tokens per sequence (``targets``: the target's)."""
        mine = self.sequences
        feeds = [unseen(targets[s.request_id], self._cached[s.request_id]) for s in mine]
        self._round = {s.request_id: self._cached[s.request_id] + len(feed)
                       for s, feed in zip(mine, feeds, strict=True)}
        self._depth = max(counts.values())
        rows = self._catch_up(feeds)
        proposals: dict[str, list[int]] = {s.request_id: [] for s in mine}
        for j in range(self._depth):
            for s, row in zip(mine, rows, strict=True):
                wanted = j < counts.get(s.request_id, 0)
                s.last_token = choose(s.request_id, j, row) if wanted else int(np.argmax(row))
                if wanted:
                    proposals[s.request_id].append(s.last_token)
            if j + 1 < self._depth:  # the last proposal is never fed: verify decides it
                rows = list(self.step())
        return proposals

    def _catch_up(self, feeds: list[list[int]]) -> list[np.ndarray]:
        """Feed each sequence its unseen tokens; the draft's next-token row of each."""
        for s, feed in zip(self.sequences, feeds, strict=True):
            s.last_token = feed[0]
        if all(len(feed) == 1 for feed in feeds):
            return list(self.step())
        blocks, widths = verify_rows(self.model, self._head, self._groups,
                                     [feed[1:] for feed in feeds], self.before_group)
        settle_groups(self._groups, widths, [len(feed) for feed in feeds])
        return [block[-1] for block in blocks]

    def settle(self, accepted: dict[str, int]) -> None:
        """Keep each sequence's first ``accepted[rid]`` proposals in the draft's K/V."""
        fed = self._depth - 1  # proposals in the cache after the last draft step
        if fed < 0:
            return
        for group in self._groups:
            mine = group.sequences
            keep = [min(accepted.get(s.request_id, 0), fed) for s in mine]
            drop_rows(group, [fed - k for k in keep])
            group.lengths = [n - fed + k for n, k in zip(group.lengths, keep, strict=True)]
            for s, k in zip(mine, keep, strict=True):
                self._cached[s.request_id] = self._round[s.request_id] + k
        self._depth = 0
