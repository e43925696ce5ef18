"""Link records: what the plaintext of one encrypted WebSocket message holds.

The first byte says the kind (docs/protocol.md §3). BATCH (minor version 1)
packs several small frames into one record: one seal, one WebSocket message
and one socket write for a burst of token results instead of one per frame.
"""

from __future__ import annotations

import struct

from mlxcel_plugin.errors import ProtocolError

KIND_FRAME, KIND_BULK, KIND_PART, KIND_LAST, KIND_BATCH = 0, 1, 2, 3, 4
BATCH_MIN_MINOR = 1  # peers of an older minor version get one frame per record
_FRAME_LEN = struct.Struct(">I")
BATCH_OVERHEAD_BYTES = _FRAME_LEN.size  # per frame, beyond its encoded bytes


class MalformedRecord(ProtocolError):
    code = "record_malformed"


def frame_record(encoded_frame: bytes | memoryview) -> bytes:
    return b"".join((bytes([KIND_FRAME]), encoded_frame))


def batch_record(encoded_frames: list[bytes]) -> bytes:
    """One record carrying every frame, in order: (u32 length ‖ frame)…"""
    parts = [bytes([KIND_BATCH])]
    for encoded in encoded_frames:
        parts += (_FRAME_LEN.pack(len(encoded)), encoded)
    return b"".join(parts)


def split_batch(payload: memoryview) -> list[memoryview]:
    """The encoded frames of a BATCH record body (views into ``payload``)."""
    frames, pos, end = [], 0, len(payload)
    while pos < end:  # each pass consumes at least the 4-byte length
        if end - pos < _FRAME_LEN.size:
            raise MalformedRecord("batch record ends inside a frame length")
        (n_bytes,) = _FRAME_LEN.unpack_from(payload, pos)
        pos += _FRAME_LEN.size
        if n_bytes == 0 or n_bytes > end - pos:
            raise MalformedRecord(f"batch frame of {n_bytes} bytes does not fit the record")
        frames.append(payload[pos:pos + n_bytes])
        pos += n_bytes
    if not frames:
        raise MalformedRecord("empty batch record")
    return frames
