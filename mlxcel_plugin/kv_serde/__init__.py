"""KV handoff serialization (sans-I/O): CacheState ⇄ KVMessages.

Sender: ``KVWriter`` (or ``SerializableCacheState.to_messages``). Receiver:
``KVAssembler``. Transfer strategies (``mlxcel_plugin.transfer``) decide when
and on which lane each message goes.
"""

from mlxcel_plugin.kv_codecs import CodecError, CorruptChunk, UnknownCodec
from mlxcel_plugin.kv_serde.assemble import assemble_messages
from mlxcel_plugin.kv_serde.assembler import KVAssembler
from mlxcel_plugin.kv_serde.delta import can_ship_delta, delta_layer
from mlxcel_plugin.kv_serde.errors import (
    AdoptFailed,
    ChecksumMismatch,
    FingerprintMismatch,
    LayerCountMismatch,
    MalformedHandoff,
    OversizeDeclared,
    PrefixMissing,
    RequestMismatch,
    StaleEpoch,
    TruncatedLayer,
    UnexpectedMessage,
    UnsupportedCacheKind,
    UnsupportedHandoffVersion,
)
from mlxcel_plugin.kv_serde.header import (
    DELTA_SERDE_VERSION,
    SERDE_VERSION,
    SUPPORTED_CACHE_KINDS,
    HandoffHeader,
    ModelFingerprint,
    SerializableSamplingState,
)
from mlxcel_plugin.kv_serde.limits import AssemblerLimits
from mlxcel_plugin.kv_serde.messages import (
    AckHeader,
    ChunkHeader,
    EndHeader,
    KVMessage,
    LayerDescriptor,
    make_ack,
)
from mlxcel_plugin.kv_serde.pool import DEFAULT_POOL_BYTES, BufferPool
from mlxcel_plugin.kv_serde.receive_memory import ReceiveMemory
from mlxcel_plugin.kv_serde.state import SerializableCacheState
from mlxcel_plugin.kv_serde.writer import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    RECORD_BYTES,
    KVWriter,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DELTA_SERDE_VERSION",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_POOL_BYTES",
    "RECORD_BYTES",
    "SERDE_VERSION",
    "SUPPORTED_CACHE_KINDS",
    "AckHeader",
    "AdoptFailed",
    "AssemblerLimits",
    "BufferPool",
    "ChecksumMismatch",
    "ChunkHeader",
    "CodecError",
    "CorruptChunk",
    "EndHeader",
    "FingerprintMismatch",
    "HandoffHeader",
    "KVAssembler",
    "KVMessage",
    "KVWriter",
    "LayerCountMismatch",
    "LayerDescriptor",
    "MalformedHandoff",
    "ModelFingerprint",
    "OversizeDeclared",
    "PrefixMissing",
    "ReceiveMemory",
    "RequestMismatch",
    "SerializableCacheState",
    "SerializableSamplingState",
    "StaleEpoch",
    "TruncatedLayer",
    "UnexpectedMessage",
    "UnknownCodec",
    "UnsupportedCacheKind",
    "UnsupportedHandoffVersion",
    "assemble_messages",
    "can_ship_delta",
    "delta_layer",
    "make_ack",
]
