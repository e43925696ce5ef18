"""The frame codec: the plaintext of a record. Pure encode/decode, no I/O.

Layout: ``type u8 | header_len u32 BE | header (msgpack map) | body (raw bytes)``.
The header is small metadata; bulk data (token ids of a prompt, KV tensors)
travels as raw bytes in the body, never JSON or base64. Every optional header
field has a default and unknown fields are ignored, so minor versions
interoperate. The typed frames built on it are in ``frames``; see docs/protocol.md.
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.protocol.body_parts import BodyParts

MAX_HEADER_BYTES = 1024 * 1024
MAX_PROMPT_TOKENS = 1_048_576  # prompt admission cap on REQUEST frames
_PREFIX = struct.Struct(">BI")
_TOKEN_ITEMSIZE = 4  # prompt token ids travel as uint32 little-endian
MSGPACK_INT_MIN, MSGPACK_INT_MAX = -(1 << 63), (1 << 64) - 1


class FrameError(ProtocolError):
    code = "bad_frame"


class MalformedFrame(FrameError):
    code = "frame_malformed"


class UnknownFrameType(FrameError):
    """A type this version does not know (a newer minor peer); links skip these."""

    code = "frame_unknown_type"


class PromptTooLong(FrameError):
    code = "prompt_too_long"


class FrameType(enum.IntEnum):
    REQUEST = 1
    RESULT = 2
    KV_BEGIN = 3
    KV_CHUNK = 4
    KV_END = 5
    KV_ACK = 6
    CANCEL = 7
    TELEMETRY = 8
    PING = 9
    PONG = 10
    ERROR = 11
    ADAPTER = 12  # LoRA adapter load/unload (adapter_frames.py)


Body = bytes | bytearray | memoryview | BodyParts


@dataclass(frozen=True)
class Frame:
    type: FrameType
    header: dict[str, Any] = field(default_factory=dict)
    body: Body = b""

    def __repr__(self) -> str:
        # Bodies can be megabytes of tensor bytes: show their size only.
        return f"Frame({self.type.name}, header={self.header!r}, body={len(self.body)} bytes)"


# ---------------------------------------------------------------- generic codec


def encode_header(frame_type: FrameType, header: Mapping[str, Any]) -> bytes:
    """Type byte, header length and header: everything before the body."""
    try:
        packed = msgpack.packb(dict(header), use_bin_type=True)
    except OverflowError:
        raise _out_of_range(header) from None
    except (TypeError, ValueError) as exc:
        raise MalformedFrame(f"frame header cannot be encoded: {exc}") from None
    if len(packed) > MAX_HEADER_BYTES:
        raise MalformedFrame(f"frame header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
    return _PREFIX.pack(int(frame_type), len(packed)) + packed


class HeaderIntOutOfRange(MalformedFrame):
    """A header integer msgpack cannot carry (outside [-2**63, 2**64 - 1])."""

    code = "frame_field_out_of_range"


def _out_of_range(header: Mapping[str, Any]) -> HeaderIntOutOfRange:
    """Name the field that overflowed (only on the failure path: no cost per frame)."""
    path = _overflowing_path(header, "")
    return HeaderIntOutOfRange(f"frame header field {path or '?'!r} holds an integer outside "
                               f"the link's 64-bit range [{MSGPACK_INT_MIN}, {MSGPACK_INT_MAX}]")


def _overflowing_path(value: Any, path: str) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return path if not MSGPACK_INT_MIN <= value <= MSGPACK_INT_MAX else None
    if isinstance(value, Mapping):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for p, v in items if (found := _overflowing_path(v, p))), None)


def encode_frame(frame: Frame) -> bytes:
    return encode_header(frame.type, frame.header) + bytes(frame.body)


def frame_size(frame: Frame) -> int:
    """Encoded size without encoding the body (for queue accounting)."""
    return len(encode_header(frame.type, frame.header)) + len(frame.body)


def _unpack_header(raw: memoryview) -> dict[str, Any]:
    try:
        # msgpack bounds every length by the buffer size, so a crafted length
        # cannot allocate more than the header bytes we already hold.
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise MalformedFrame("frame header is not valid msgpack") from None
    if not isinstance(header, dict):
        raise MalformedFrame("frame header is not a map")
    return header


def split_frame(data: Body) -> tuple[int, dict[str, Any], memoryview]:
    """Parse without checking the type: (type code, header, body view)."""
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    if len(view) < _PREFIX.size:
        raise MalformedFrame(f"frame of {len(view)} bytes is shorter than its prefix")
    type_code, header_len = _PREFIX.unpack_from(view)
    if header_len > MAX_HEADER_BYTES or header_len > len(view) - _PREFIX.size:
        raise MalformedFrame(f"frame header length {header_len} out of bounds")
    end = _PREFIX.size + header_len
    return type_code, _unpack_header(view[_PREFIX.size:end]), view[end:]


def decode_frame(data: Body) -> Frame:
    """Parse a frame; the body is a zero-copy view into ``data``."""
    type_code, header, body = split_frame(data)
    try:
        frame_type = FrameType(type_code)
    except ValueError:
        raise UnknownFrameType(f"unknown frame type {type_code}") from None
    return Frame(frame_type, header, body)


# ---------------------------------------------------------------- header fields


def get_field(header: Mapping[str, Any], name: str, kinds: type | tuple[type, ...],
         default: Any = None, *, required: bool = False) -> Any:
    """One typed header field, with its default when absent."""
    if name not in header or header[name] is None:
        if required:
            raise MalformedFrame(f"frame header lacks {name!r}")
        return default
    value = header[name]
    # bool is an int subclass; a peer sending `true` for a count is still malformed.
    if not isinstance(value, kinds) or (isinstance(value, bool) and kinds is not bool):
        raise MalformedFrame(f"frame header field {name!r} has the wrong type")
    return value


def get_int_list(header: Mapping[str, Any], name: str) -> list[int]:
    values = get_field(header, name, list, [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise MalformedFrame(f"frame header field {name!r} must be a list of ints")
    return values


def expect_type(frame: Frame, frame_type: FrameType) -> None:
    if frame.type is not frame_type:
        raise MalformedFrame(f"expected a {frame_type.name} frame, got {frame.type.name}")


# ---------------------------------------------------------------- token ids in bodies


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    arr = array("I", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def unpack_token_ids(body: Body, max_tokens: int = MAX_PROMPT_TOKENS) -> list[int]:
    n_bytes = len(body)
    if n_bytes % _TOKEN_ITEMSIZE:
        raise MalformedFrame("token id body is not a whole number of uint32")
    if n_bytes // _TOKEN_ITEMSIZE > max_tokens:
        raise PromptTooLong(
            f"prompt of {n_bytes // _TOKEN_ITEMSIZE} tokens exceeds the cap of {max_tokens}"
        )
    arr = array("I")
    arr.frombytes(body)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()
