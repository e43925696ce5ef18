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

    def limit(self, sequence: Any) -> int:
        """Most tokens to propose this step (called once per step; none past ``max_tokens``:
        the verify row yields one more)."""
        if not self.active:
            return 0
        limit = self.controller.proposal_limit()
        if sequence.steps_left is not None:
            limit = min(limit, sequence.steps_left - 1)
        return max(0, limit)

    def ngram_proposals(self, sequence: Any, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed an earlier match of the context's end."""
        prompt = len(sequence.request.prompt_tokens) if sequence.request is not None else 0
        self.index.extend(sequence.generated[len(self.index) - prompt :])
        return self.index.propose(limit)
