"""Link records: what the plaintext of one encrypted WebSocket message holds.

The first byte says the kind (docs/protocol.md §3). BATCH (minor version 1)
packs several small frames into one record: one seal, one WebSocket message
and one socket write for a burst of token results instead of one per frame.
``RecordReader`` turns received plaintexts back into frames, without I/O.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.protocol.frames import (
    BodyParts,
    Frame,
    FrameType,
    UnknownFrameType,
    decode_frame,
    split_frame,
)

logger = logging.getLogger("mlxcel_plugin.link")

KIND_FRAME, KIND_BULK, KIND_PART, KIND_LAST, KIND_BATCH = 0, 1, 2, 3, 4
KIND_BULK_LANE = 5  # a BULK record naming its lane (u8) first; only on links of > 1 lane
BATCH_MIN_MINOR = 1  # peers of an older minor version get one frame per record
_FRAME_LEN = struct.Struct(">I")
BULK_LEN = struct.Struct(">Q")  # a BULK record: body length, then the frame without its body
BATCH_OVERHEAD_BYTES = _FRAME_LEN.size  # per frame, beyond its encoded bytes


class MalformedRecord(ProtocolError):
    code = "record_malformed"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


def frame_record(encoded_frame: bytes | memoryview) -> bytes:
    return b"".join((bytes([KIND_FRAME]), encoded_frame))


def bulk_record(body_bytes: int, encoded_header: bytes, lane: int | None = None) -> bytes:
    """Announces a frame whose ``body_bytes`` of body follow on the bulk channel (on
    ``lane`` where the link has several)."""
    kind = bytes([KIND_BULK]) if lane is None else bytes([KIND_BULK_LANE, lane])
    return b"".join((kind, BULK_LEN.pack(body_bytes), encoded_header))


def part_records(encoded_frame: bytes, limit: int) -> Iterator[bytes]:
    """An encoded frame too big for one record, as PART records and a LAST one."""
    view = memoryview(encoded_frame)
    for start in range(0, len(view), limit):
        kind = KIND_LAST if start + limit >= len(view) else KIND_PART
        yield b"".join((bytes([kind]), view[start:start + limit]))


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


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class BulkBody:
    """A frame announced by a BULK record; its body follows on the bulk channel."""

    type_code: int
    header: dict[str, Any]
    n_bytes: int
    lane: int = 0


class RecordReader:
    """Received record plaintexts in; the frames and bulk announcements they carry out.

    Reassembles PART… LAST (bounded by ``max_frame_bytes``) and skips frames of a
    type this version does not know (a newer minor peer may send them). BULK
    records are refused unless the link has a ``bulk`` channel.
    """

    def __init__(self, max_frame_bytes: int, *, bulk: bool, name: str = "", lanes: int = 1):
        self._max_frame_bytes, self._bulk, self._name = max_frame_bytes, bulk, name
        self._lanes = lanes
        self._parts: list[bytes] = []
        self._parts_bytes = 0

    def feed(self, plain: bytes | bytearray) -> list[Frame | BulkBody]:
        if not plain:
            raise ProtocolError("empty link record")
        kind, payload = plain[0], memoryview(plain)[1:]
        if kind == KIND_BULK:
            return [self._bulk_body(payload)]
        if kind == KIND_BULK_LANE and len(payload) > 1:
            if payload[0] >= self._lanes:
                raise ProtocolError(f"BULK record names lane {payload[0]} of {self._lanes}")
            return [self._bulk_body(payload[1:], payload[0])]
        if kind == KIND_BATCH:
            frames = (self._decode(frame) for frame in split_batch(payload))
            return [frame for frame in frames if frame is not None]
        if kind == KIND_PART:
            self._add_part(payload)
            return []
        if kind == KIND_LAST:
            self._add_part(payload)
            payload, self._parts, self._parts_bytes = b"".join(self._parts), [], 0
        elif kind != KIND_FRAME:
            raise ProtocolError(f"unknown link record kind {kind}")
        frame = self._decode(payload)
        return [] if frame is None else [frame]

    def bulk_frame(self, bulk: BulkBody, body: bytearray | memoryview | BodyParts) -> Frame | None:
        """The frame once its body arrived (None for a type this version skips)."""
        try:
            frame_type = FrameType(bulk.type_code)
            return Frame(frame_type, bulk.header, body if isinstance(body, BodyParts)
                         else memoryview(body))
        except ValueError:
            logger.debug("link %s: skipping unknown frame type %d", self._name, bulk.type_code)
            return None

    def _bulk_body(self, payload: memoryview, lane: int = 0) -> BulkBody:
        if not self._bulk or len(payload) < BULK_LEN.size:
            raise ProtocolError("BULK record on a link without a bulk channel")
        (n_bytes,) = BULK_LEN.unpack_from(payload)
        if n_bytes > self._max_frame_bytes:
            raise FrameTooLarge(f"bulk body of {n_bytes} bytes exceeds {self._max_frame_bytes}")
        type_code, header, _ = split_frame(payload[BULK_LEN.size:])
        return BulkBody(type_code, header, n_bytes, lane)

    def _add_part(self, payload: memoryview) -> None:
        self._parts_bytes += len(payload)
        if self._parts_bytes > self._max_frame_bytes:
            raise FrameTooLarge(f"fragmented frame exceeds {self._max_frame_bytes} bytes")
        self._parts.append(bytes(payload))

    def _decode(self, payload: bytes | memoryview) -> Frame | None:
        try:
            return decode_frame(payload)
        except UnknownFrameType as exc:
            # A newer minor version may add frame types; skipping keeps us compatible.
            logger.debug("link %s: skipping %s", self._name, exc.message)
            return None
