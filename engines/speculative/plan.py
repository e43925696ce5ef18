"""One sequence's speculation: its method, n-gram index and adaptive controller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.speculative.adaptive import AdaptiveController
from mlxcel_plugin.speculative.ngram import NgramIndex
from mlxcel_plugin.speculative.settings import METHOD_DRAFT, METHOD_NGRAM, SpeculativeConfig


def request_method(request: Any, config: SpeculativeConfig) -> str:
    """The request's ``speculative`` field, else the node's ``[speculative] method``."""
    asked = getattr(getattr(request, "sampling", None), "speculative", None)
    return asked or config.method


@dataclass
class SequencePlan:
    """How one sequence speculates: n-gram proposals from its own context, or the draft's."""

    method: str
    index: NgramIndex | None  # prompt lookup's index (n-gram method only)
    controller: AdaptiveController
    active: bool  # False: plain steps ("off", or "draft" where the node holds no draft)

    @classmethod
    def for_sequence(cls, sequence: Any, config: SpeculativeConfig,
                     has_draft: bool) -> SequencePlan:
        method = request_method(sequence.request, config)
        index = None
        if method == METHOD_NGRAM:
            prompt = sequence.request.prompt_tokens if sequence.request is not None else ()
            index = NgramIndex(config.ngram_min, config.ngram_max,
                               (*prompt, *sequence.generated))
        controller = AdaptiveController(config.num_speculative_tokens, config.verify_row_cost,
                                        config.adaptive)
        active = method == METHOD_NGRAM or (method == METHOD_DRAFT and has_draft)
        return cls(method, index, controller, active)

    @property
    def drafts(self) -> bool:
        return self.active and self.method == METHOD_DRAFT

    def limit(self, sequence: Any, kind: int = 0) -> int:
        """Most tokens to propose this step for a proposal of ``kind`` (called once per step
        that could propose; none past ``max_tokens``: the verify row yields one more)."""
        if not self.active:
            return 0
        return min(self.controller.proposal_limit(kind), self.most(sequence))

    def most(self, sequence: Any) -> int:
        """The cap before adapting: ``num_speculative_tokens``, and none past ``max_tokens``."""
        if not self.active:
            return 0
        most = self.controller.k_max
        if sequence.steps_left is not None:
            most = min(most, sequence.steps_left - 1)
        return max(0, most)

    def ngram_proposals(self, sequence: Any, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed an earlier match of the context's end, fewer
        (or none) where matches of that n-gram size have been accepted less."""
        prompt = len(sequence.request.prompt_tokens) if sequence.request is not None else 0
        self.index.extend(sequence.generated[len(self.index) - prompt :])
        size, found = self.index.lookup(limit)
        return found[: self.limit(sequence, size)] if found else []
