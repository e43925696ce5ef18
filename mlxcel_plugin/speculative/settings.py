"""``[speculative]``: the settings of speculative decoding (docs/speculative.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

METHOD_OFF = "off"
METHOD_NGRAM = "ngram"
METHOD_DRAFT = "draft"
# Per request too: the ``speculative`` body field ("draft" where the node holds a draft model).
METHODS = (METHOD_OFF, METHOD_NGRAM, METHOD_DRAFT)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``[speculative]`` (hybrid, decode): proposals verified in one forward."""

    # "off" | "ngram" (prompt lookup: proposals copied from the sequence's own context) |
    # "draft" (a small model with the same tokenizer proposes). A request's ``speculative``
    # body field overrides it.
    method: str = METHOD_OFF
    # The draft model's mlx-lm checkpoint directory (its tokenizer must be the target's).
    # Loaded beside the target when set, so requests may ask for "draft" whatever ``method``.
    draft_model: str = ""
    # Most tokens proposed per sequence and step.
    num_speculative_tokens: int = 4
    # N-gram sizes tried, longest first, for a match of the context's last tokens.
    ngram_max: int = 4
    # Shortest n-gram tried (1: one repeated token is enough to propose).
    ngram_min: int = 1
    # Cost of one more verified row, as a fraction of a plain decode step; the adaptive
    # rule weighs it against the acceptance rate. With ``learn_row_cost`` only until the
    # node has timed its own forwards (loadtests/bench_speculative.py measures it too).
    verify_row_cost: float = 0.1
    # Time this node's decode forwards and weigh a verified row by what it costs here (a
    # CPU pays far more per row than a GPU). Proposal counts then differ between nodes;
    # greedy and seeded tokens do not. False: ``verify_row_cost`` as set, on every node.
    learn_row_cost: bool = True
    # Per sequence, turn speculation down (fewer tokens) or off when it would be slower; per
    # batch group, propose no deeper than the group's extra rows pay for.
    adaptive: bool = True


@dataclass(frozen=True)
class MethodCounts:
    """Running totals of one method."""

    proposed: int = 0  # tokens proposed and verified
    accepted: int = 0  # of those, tokens the target model picked too
    verify_steps: int = 0  # sequence-steps that verified at least one proposal

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(frozen=True)
class SpeculativeStats:
    """Per method (``"ngram"``), since the engine started."""

    methods: dict[str, MethodCounts] = field(default_factory=dict)
