"""Named refusals of a KV handoff. Each fails only its request; ``code`` goes into the ack.

(Codec refusals — ``UnknownCodec``, ``CorruptChunk`` — live in ``kv_codecs.base``.)
"""

from __future__ import annotations

from mlxcel_plugin.errors import CacheNotTransferableError, HandoffError


class MalformedHandoff(HandoffError):
    """A header field is missing, of the wrong type, or out of range."""

    code = "handoff_malformed"


class UnsupportedHandoffVersion(HandoffError):
    code = "handoff_unsupported_version"


class RequestMismatch(HandoffError):
    """The handoff is for a request this receiver was not told to expect."""

    code = "handoff_request_mismatch"


class FingerprintMismatch(HandoffError):
    """The sender's model is not ours (architecture, heads, head_dim, dtype, classes)."""

    code = "handoff_fingerprint_mismatch"


class LayerCountMismatch(FingerprintMismatch):
    code = "handoff_layer_count_mismatch"


class UnsupportedCacheKind(HandoffError):
    """A layer's cache class cannot travel (only KVCache and RotatingKVCache can)."""

    code = "handoff_unsupported_cache_kind"


class CacheClassNotTransferable(UnsupportedCacheKind, CacheNotTransferableError):
    """The model keeps a cache class with no handoff form at all: a 501 naming it."""

    code = CacheNotTransferableError.code


class StaleEpoch(HandoffError):
    """A message from an older (or another) attempt of this handoff."""

    code = "handoff_stale_epoch"


class OversizeDeclared(HandoffError):
    """Declared sizes exceed the record bound or this node's byte budget."""

    code = "handoff_oversize"


class TruncatedLayer(HandoffError):
    """A layer's K or V is incomplete when the handoff ends, or a body is short."""

    code = "handoff_truncated_layer"


class ChecksumMismatch(HandoffError):
    code = "handoff_checksum_mismatch"


class UnexpectedMessage(HandoffError):
    """A message out of place: chunk before begin, duplicate chunk, conflicting begin."""

    code = "handoff_unexpected_message"


class AdoptFailed(HandoffError):
    """The engine could not take a received layer into its own arrays."""

    code = "handoff_adopt_failed"


class PrefixMissing(HandoffError):
    """A delta for a prefix this receiver does not hold; the sender retries in full."""

    code = "prefix_missing"
