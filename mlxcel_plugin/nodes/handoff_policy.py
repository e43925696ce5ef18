"""How a prefill node reads a decode node's refusal, and when a handoff may be a delta.

Pure decisions, kept apart from the node's plumbing (docs/cluster-flow.md).
"""

from __future__ import annotations

from mlxcel_plugin.kv_serde import HandoffHeader, ModelFingerprint, can_ship_delta

# Refusals that another attempt cannot cure: give up at once.
FINAL_REFUSALS = frozenset({
    "handoff_fingerprint_mismatch", "handoff_layer_count_mismatch",
    "handoff_unsupported_cache_kind", "handoff_unsupported_version", "handoff_oversize",
    "unknown_request",
})  # fmt: skip
# A delta refused for these goes again in full, at once: the decode node does not hold
# the prefix (any more), or is too old to splice one (it refuses the delta's serde version).
FULL_RETRY_REFUSALS = frozenset({"prefix_missing", "handoff_unsupported_version"})


def delta_prefix_tokens(decode_cached_tokens: int, pinned: bool,
                        fingerprint: ModelFingerprint) -> int:
    """The prefix a handoff may leave out: the router's count, for the node it chose.

    0 (a full handoff) without a router-chosen target (the count is about that
    node) or for a model whose layers cannot be cut at a position.
    """
    if not pinned or not can_ship_delta(fingerprint):
        return 0
    return max(0, decode_cached_tokens)


def retries_in_full(code: str, header: HandoffHeader) -> bool:
    """Whether a refused attempt should go again at once with the whole cache."""
    return header.prefix_tokens > 0 and code in FULL_RETRY_REFUSALS
