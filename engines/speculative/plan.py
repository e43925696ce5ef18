"""One sequence's speculation: its method, n-gram index and adaptive controller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.speculative.adaptive import AdaptiveController
from mlxcel_plugin.speculative.ngram import NgramIndex
from mlxcel_plugin.speculative.settings import METHOD_NGRAM, SpeculativeConfig


def request_method(request: Any, config: SpeculativeConfig) -> str:
    """The request's ``speculative`` field, else the node's ``[speculative] method``."""
    asked = getattr(getattr(request, "sampling", None), "speculative", None)
    return asked or config.method


@dataclass
class SequencePlan:
    """Proposals for one sequence, from its own context (prompt + generated)."""

    method: str
    index: NgramIndex
    controller: AdaptiveController

    @classmethod
    def for_sequence(cls, sequence: Any, config: SpeculativeConfig) -> SequencePlan:
        method = request_method(sequence.request, config)
        prompt = sequence.request.prompt_tokens if sequence.request is not None else ()
        context = (*prompt, *sequence.generated) if method == METHOD_NGRAM else ()  # else unused
        index = NgramIndex(config.ngram_min, config.ngram_max, context)
        controller = AdaptiveController(config.num_speculative_tokens, config.verify_row_cost,
                                        config.adaptive)
        return cls(method, index, controller)

    @property
    def active(self) -> bool:
        return self.method == METHOD_NGRAM  # the only method so far

    def propose(self, sequence: Any) -> list[int]:
        """This step's proposals (none past ``max_tokens``: the verify row yields one more)."""
        prompt = len(sequence.request.prompt_tokens) if sequence.request is not None else 0
        self.index.extend(sequence.generated[len(self.index) - prompt :])
        limit = self.controller.proposal_limit()
        if sequence.steps_left is not None:
            limit = min(limit, sequence.steps_left - 1)
        return self.index.propose(limit)
