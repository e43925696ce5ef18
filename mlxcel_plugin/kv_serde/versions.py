"""Handoff serde versions: what each adds, and what the end's checksums cover.

A sender uses a version above 1 only towards a peer that announced it
(``nodes/kv_wire.py``); a receiver refuses a version it does not speak at the begin.
"""

from __future__ import annotations

from mlxcel_plugin.link.protocol.checksum import crc32_combine

SERDE_VERSION = 1  # a full handoff
# A delta handoff (``prefix_tokens`` > 0): a receiver older than it refuses it at the begin
# (``handoff_unsupported_version``) instead of taking the shorter layers for the whole cache.
DELTA_SERDE_VERSION = 2
# ``checksum_of = "encoded"``: the end's checksums cover the chunk bodies as sent, not the
# decoded bytes. A lossy codec's sender then need not decode its own output to know what the
# receiver will hold, and two nodes whose float kernels round differently (int8's rotation is
# a BLAS matmul) still agree. Sent only to peers that announce it (``nodes/kv_wire.py``); a node
# that cannot combine crc32s of chunks arriving out of order does not.
BODY_CHECKSUM_SERDE_VERSION = 3
# ``checksum_of = "none"``: raw (codec ``none``) bodies carry no crc32 at all. Each record's
# AES-GCM tag already authenticates the exact bytes that land, so a crc32 on each side was
# one more pass over every byte for nothing the tag misses. Codecs that transform the bytes
# keep a digest. Sent only to peers that announce it, like version 3.
AEAD_ONLY_SERDE_VERSION = 4
# Chunk bodies up to ``LARGE_CHUNK_BYTES``, not one link record's 8 MiB − 64 KiB: an 8B
# model's 16 MiB tensor (8k tokens) then goes as one chunk, not three, and each chunk costs
# both ends a round of Python bookkeeping. Bodies no longer need to fit a record (the bulk
# lanes and PART records carry any frame), so only a receiver's budget bounds them. Sent
# only to peers that announce it, like version 3.
LARGE_CHUNK_SERDE_VERSION = 5
LARGE_CHUNK_BYTES = 32 << 20  # the receiver's bound on one chunk's decoded bytes, too
SUPPORTED_SERDE_VERSIONS = (SERDE_VERSION, DELTA_SERDE_VERSION) + (
    (BODY_CHECKSUM_SERDE_VERSION,) if crc32_combine is not None else ()) + (
    AEAD_ONLY_SERDE_VERSION, LARGE_CHUNK_SERDE_VERSION)
CHECKSUM_OF_HELD, CHECKSUM_OF_ENCODED, CHECKSUM_OF_NONE = "held", "encoded", "none"
CHECKSUM_VERSIONS = {CHECKSUM_OF_HELD: SERDE_VERSION, CHECKSUM_OF_ENCODED:
                      BODY_CHECKSUM_SERDE_VERSION, CHECKSUM_OF_NONE: AEAD_ONLY_SERDE_VERSION}
IDENTITY_CODEC = "none"  # the only codec whose bodies are the bytes held
