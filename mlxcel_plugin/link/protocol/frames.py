"""Link frames: the plaintext of a record. Pure encode/decode, no I/O.

Layout: ``type u8 | header_len u32 BE | header (msgpack map) | body (raw bytes)``.
The header is small metadata; bulk data (token ids of a prompt, KV tensors)
travels as raw bytes in the body, never JSON or base64. Every optional header
field has a default and unknown fields are ignored, so minor versions
interoperate. See docs/protocol.md.
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.protocol.body_parts import BodyParts

MAX_HEADER_BYTES = 1024 * 1024
MAX_PROMPT_TOKENS = 1_048_576  # prompt admission cap on REQUEST frames
_PREFIX = struct.Struct(">BI")
_TOKEN_ITEMSIZE = 4  # prompt token ids travel as uint32 little-endian


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
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedFrame(f"frame header cannot be encoded: {exc}") from None
    if len(packed) > MAX_HEADER_BYTES:
        raise MalformedFrame(f"frame header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
    return _PREFIX.pack(int(frame_type), len(packed)) + packed


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


def _get(header: Mapping[str, Any], name: str, kinds: type | tuple[type, ...],
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


def _int_list(header: Mapping[str, Any], name: str) -> list[int]:
    values = _get(header, name, list, [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise MalformedFrame(f"frame header field {name!r} must be a list of ints")
    return values


def _expect_type(frame: Frame, frame_type: FrameType) -> None:
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


# ---------------------------------------------------------------- typed frames


@dataclass(frozen=True)
class Request:
    """Router → prefill: one generation request, in token ids.

    Router → decode: the same frame with ``claim=True`` and an empty prompt
    registers the lease — that router link owns the request and gets its tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    decode_target: str | None = None  # host:port chosen by the router
    deadline_unix_s: float | None = None  # wall clock, None = no deadline
    claim: bool = False  # a decode lease, not work to run; the prompt may be empty

    TYPE: ClassVar[FrameType] = FrameType.REQUEST

    def to_frame(self) -> Frame:
        if len(self.prompt_token_ids) > MAX_PROMPT_TOKENS:
            raise PromptTooLong(f"prompt of {len(self.prompt_token_ids)} tokens exceeds "
                                f"the cap of {MAX_PROMPT_TOKENS}")
        header = {"request_id": self.request_id, "sampling": self.sampling,
                  "max_tokens": self.max_tokens, "stop_token_ids": list(self.stop_token_ids),
                  "decode_target": self.decode_target, "deadline_unix_s": self.deadline_unix_s}
        if self.claim:
            # Only when set: a plain request keeps its golden bytes.
            header["claim"] = True
        return Frame(self.TYPE, header, pack_token_ids(self.prompt_token_ids))

    @classmethod
    def from_frame(cls, frame: Frame) -> Request:
        _expect_type(frame, cls.TYPE)
        h = frame.header
        return cls(
            request_id=_get(h, "request_id", str, required=True),
            prompt_token_ids=unpack_token_ids(frame.body),
            sampling=_get(h, "sampling", dict, {}),
            max_tokens=_get(h, "max_tokens", int, 256),
            stop_token_ids=_int_list(h, "stop_token_ids"),
            decode_target=_get(h, "decode_target", str),
            deadline_unix_s=_float_or_none(h, "deadline_unix_s"),
            claim=_get(h, "claim", bool, False),
        )


def _float_or_none(header: Mapping[str, Any], name: str) -> float | None:
    value = _get(header, name, (int, float))
    return None if value is None else float(value)


@dataclass(frozen=True)
class Result:
    """Prefill/decode → router: tokens for one request, in order by ``seq``."""

    request_id: str
    seq: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"; None = more
    generated_tokens: int = 0
    error: str | None = None
    # With the first token: prompt tokens served from the prefill node's prefix cache.
    cached_tokens: int = 0

    TYPE: ClassVar[FrameType] = FrameType.RESULT

    def to_frame(self) -> Frame:
        header = {
            "request_id": self.request_id, "seq": self.seq, "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason, "generated_tokens": self.generated_tokens,
            "error": self.error,
        }
        if self.cached_tokens:  # absent means 0: older peers send and read the same bytes
            header["cached_tokens"] = self.cached_tokens
        return Frame(self.TYPE, header)

    @classmethod
    def from_frame(cls, frame: Frame) -> Result:
        _expect_type(frame, cls.TYPE)
        h = frame.header
        return cls(
            request_id=_get(h, "request_id", str, required=True),
            seq=_get(h, "seq", int, required=True),
            token_ids=_int_list(h, "token_ids"),
            finish_reason=_get(h, "finish_reason", str),
            generated_tokens=_get(h, "generated_tokens", int, 0),
            error=_get(h, "error", str),
            cached_tokens=_get(h, "cached_tokens", int, 0),
        )


@dataclass(frozen=True)
class Cancel:
    request_id: str
    reason: str = ""

    TYPE: ClassVar[FrameType] = FrameType.CANCEL

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, {"request_id": self.request_id, "reason": self.reason})

    @classmethod
    def from_frame(cls, frame: Frame) -> Cancel:
        _expect_type(frame, cls.TYPE)
        h = frame.header
        return cls(_get(h, "request_id", str, required=True), _get(h, "reason", str, ""))


@dataclass(frozen=True)
class Telemetry:
    """Live load of a node, sent periodically over its links (feeds the balancers)."""

    node_id: str
    role: str
    queue_depth: int = 0
    active_sequences: int = 0
    free_kv_fraction: float = 1.0
    tokens_per_s: float = 0.0
    # The node's prefix cache: running totals of tokens hit and looked up, bytes held now.
    prefix_hit_tokens: int = 0
    prefix_lookup_tokens: int = 0
    prefix_cached_bytes: int = 0

    TYPE: ClassVar[FrameType] = FrameType.TELEMETRY
    _PREFIX_FIELDS: ClassVar[tuple[str, ...]] = (
        "prefix_hit_tokens", "prefix_lookup_tokens", "prefix_cached_bytes",
    )

    def to_frame(self) -> Frame:
        header = {
            "node_id": self.node_id, "role": self.role, "queue_depth": self.queue_depth,
            "active_sequences": self.active_sequences,
            "free_kv_fraction": float(self.free_kv_fraction),
            "tokens_per_s": float(self.tokens_per_s),
        }
        # Absent means 0, so a node without a prefix cache sends the bytes it always did.
        header.update({k: getattr(self, k) for k in self._PREFIX_FIELDS if getattr(self, k)})
        return Frame(self.TYPE, header)

    @classmethod
    def from_frame(cls, frame: Frame) -> Telemetry:
        _expect_type(frame, cls.TYPE)
        h = frame.header
        return cls(
            node_id=_get(h, "node_id", str, required=True),
            role=_get(h, "role", str, required=True),
            queue_depth=_get(h, "queue_depth", int, 0),
            active_sequences=_get(h, "active_sequences", int, 0),
            free_kv_fraction=float(_get(h, "free_kv_fraction", (int, float), 1.0)),
            tokens_per_s=float(_get(h, "tokens_per_s", (int, float), 0.0)),
            **{k: _get(h, k, int, 0) for k in cls._PREFIX_FIELDS},
        )


@dataclass(frozen=True)
class Ping:
    """Application-level ping; a Link answers it with a PONG carrying the same nonce."""

    nonce: int = 0
    sent_at_s: float = 0.0  # sender's monotonic clock, echoed back

    TYPE: ClassVar[FrameType] = FrameType.PING

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, {"nonce": self.nonce, "sent_at_s": float(self.sent_at_s)})

    @classmethod
    def from_frame(cls, frame: Frame) -> Ping:
        if frame.type not in (FrameType.PING, FrameType.PONG):
            raise MalformedFrame(f"expected a PING or PONG frame, got {frame.type.name}")
        h = frame.header
        return cls(_get(h, "nonce", int, 0), float(_get(h, "sent_at_s", (int, float), 0.0)))

    def pong(self) -> Frame:
        return Frame(FrameType.PONG, {"nonce": self.nonce, "sent_at_s": float(self.sent_at_s)})


@dataclass(frozen=True)
class ErrorFrame:
    """A failure the peer should know about; ``code`` is an errors.py code name."""

    code: str
    message: str = ""
    request_id: str | None = None

    TYPE: ClassVar[FrameType] = FrameType.ERROR

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, {"code": self.code, "message": self.message,
                                 "request_id": self.request_id})

    @classmethod
    def from_frame(cls, frame: Frame) -> ErrorFrame:
        _expect_type(frame, cls.TYPE)
        h = frame.header
        return cls(_get(h, "code", str, required=True), _get(h, "message", str, ""),
                   _get(h, "request_id", str))


def kv_frame(frame_type: FrameType, header: Mapping[str, Any], body: Body = b"") -> Frame:
    """KV_BEGIN/CHUNK/END/ACK: the KV layer owns the header fields; frames just carry them."""
    if frame_type not in (FrameType.KV_BEGIN, FrameType.KV_CHUNK, FrameType.KV_END,
                          FrameType.KV_ACK):
        raise ValueError(f"{frame_type.name} is not a KV frame type")
    return Frame(frame_type, dict(header), body)


TYPED_FRAMES: dict[FrameType, type] = {
    FrameType.REQUEST: Request, FrameType.RESULT: Result, FrameType.CANCEL: Cancel,
    FrameType.TELEMETRY: Telemetry, FrameType.PING: Ping, FrameType.PONG: Ping,
    FrameType.ERROR: ErrorFrame,
}


def parse_typed(frame: Frame) -> Any:
    """The typed dataclass for a frame, or the frame itself for KV frames."""
    cls = TYPED_FRAMES.get(frame.type)
    return frame if cls is None else cls.from_frame(frame)
