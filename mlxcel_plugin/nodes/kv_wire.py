"""KVMessage ⇄ link Frame: the handoff layer's messages on the wire (pure).

``KV_END`` frames also carry ``first_token``: a streamed handoff sends its
begin before prefill has sampled the first token, so the token the decode
node continues from travels with the end (EndHeader ignores the extra key).
"""

from __future__ import annotations

from mlxcel_plugin.frames import Frame, FrameType, kv_frame
from mlxcel_plugin.kv_serde import KVMessage, MalformedHandoff

KIND_TO_TYPE = {
    "begin": FrameType.KV_BEGIN,
    "chunk": FrameType.KV_CHUNK,
    "end": FrameType.KV_END,
    "ack": FrameType.KV_ACK,
}
TYPE_TO_KIND = {frame_type: kind for kind, frame_type in KIND_TO_TYPE.items()}
KV_TYPES = frozenset(KIND_TO_TYPE.values())
FIRST_TOKEN_KEY = "first_token"


def message_to_frame(message: KVMessage, first_token: int | None = None) -> Frame:
    header = dict(message.header)
    if message.kind == "end" and first_token is not None:
        header[FIRST_TOKEN_KEY] = first_token
    return kv_frame(KIND_TO_TYPE[message.kind], header, message.body)


def frame_to_message(frame: Frame) -> KVMessage:
    kind = TYPE_TO_KIND.get(frame.type)
    if kind is None:
        raise MalformedHandoff(f"{frame.type.name} is not a KV frame")
    return KVMessage(kind, frame.header, frame.body)


def end_first_token(frame: Frame) -> int | None:
    """The first token a KV_END frame carries, or None (then the begin header's counts)."""
    value = frame.header.get(FIRST_TOKEN_KEY)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise MalformedHandoff("KV_END first_token must be a token id")
    return value
