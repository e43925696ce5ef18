"""KVMessage ⇄ link Frame: the handoff layer's messages on the wire (pure).

A KV_CHUNK frame carries one chunk (its header is the chunk's header) or
several: ``{"handoff_id", "epoch", "chunks": [chunk header, ...]}`` with the
bodies back to back (a ``BodyParts`` when sent). Why several: each frame costs
both ends a link round of bookkeeping (~0.7 ms of the decode node's event loop
for a 16 MiB frame of an 8B model's shape), and a 64 MiB cache of SmolLM2's shape
is 60 tensors of ~1 MiB. ``frames_for`` joins consecutive chunks for the same
lane up to a byte bound; it never waits for more. ``frame_chunk_bytes`` sizes that
bound to what is queued: as large as leaves every bulk lane a body of its own, from
``FRAME_CHUNK_BYTES`` up to ``FRAME_MAX_CHUNK_BYTES``, since each frame's body goes on
one lane (a handoff under 64 MiB in one 64 MiB frame would use one lane of several).
Why larger when there is enough: 64 MiB frames against 16 MiB ones saved the decode
node's event loop 4 ms per 2k-token handoff of an 8B model's shape and 19 ms per
8k-token one (docs/bulk-lanes.md#bodies-on-lanes). Not larger than 64 MiB: a frame's
layers are adopted only once its whole body is in.

``KV_END`` frames also carry ``first_token``: a streamed handoff sends its
begin before prefill has sampled the first token, so the token the decode
node continues from travels with the end (EndHeader ignores the extra key).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mlxcel_plugin.kv_serde import KVMessage, MalformedHandoff
from mlxcel_plugin.kv_serde.header import SUPPORTED_SERDE_VERSIONS
from mlxcel_plugin.kv_serde.landing import LandedDecode
from mlxcel_plugin.link.protocol.frames import Body, BodyParts, Frame, FrameType, kv_frame

KIND_TO_TYPE = {
    "begin": FrameType.KV_BEGIN,
    "chunk": FrameType.KV_CHUNK,
    "end": FrameType.KV_END,
    "ack": FrameType.KV_ACK,
}
TYPE_TO_KIND = {frame_type: kind for kind, frame_type in KIND_TO_TYPE.items()}
KV_TYPES = frozenset(KIND_TO_TYPE.values())
FIRST_TOKEN_KEY = "first_token"
CHUNKS_KEY = "chunks"
FRAME_CHUNK_BYTES = 16 * 1024 * 1024  # chunk bodies joined into one frame, at least this far
FRAME_MAX_CHUNK_BYTES = 64 * 1024 * 1024  # ... and at most this far (frame_chunk_bytes)
FRAME_MAX_CHUNKS = 64  # keeps a joined frame's header small
_RECEIVE_MAX_CHUNKS = 1024  # what a receiver accepts in one frame


def message_to_frame(message: KVMessage, first_token: int | None = None) -> Frame:
    header = dict(message.header)
    if message.kind == "end" and first_token is not None:
        header[FIRST_TOKEN_KEY] = first_token
    return kv_frame(KIND_TO_TYPE[message.kind], header, message.body)


def chunks_frame(chunks: Sequence[KVMessage]) -> Frame:
    """One KV_CHUNK frame for chunks of one handoff (a single chunk keeps its own header)."""
    if len(chunks) == 1:
        return message_to_frame(chunks[0])
    first = chunks[0].header
    header = {
        "handoff_id": first.get("handoff_id"),
        "epoch": first.get("epoch"),
        CHUNKS_KEY: [dict(chunk.header) for chunk in chunks],
    }
    return kv_frame(FrameType.KV_CHUNK, header, BodyParts([chunk.body for chunk in chunks]))


def frame_chunk_bytes(messages: Sequence[KVMessage], bulk_lanes: Sequence[int]) -> int:
    """How far ``frames_for`` joins ``messages``' chunks: their bytes spread over a frame per
    bulk lane of the links they go on (``bulk_lanes``: each link's; one without a bulk
    channel carries one body at a time), within ``FRAME_CHUNK_BYTES``..``FRAME_MAX_CHUNK_BYTES``."""
    queued = sum(len(m.body) for m in messages if m.kind == "chunk")
    per_lane = -(-queued // max(1, sum(max(1, lanes) for lanes in bulk_lanes)))
    return max(FRAME_CHUNK_BYTES, min(FRAME_MAX_CHUNK_BYTES, per_lane))


def frames_for(
    messages: Sequence[KVMessage],
    first_token: int | None = None,
    max_chunk_bytes: int = FRAME_CHUNK_BYTES,
) -> list[tuple[int, Frame]]:
    """(lane, frame) for each frame, in order: consecutive chunks on one lane share a frame."""
    out: list[tuple[int, Frame]] = []
    run: list[KVMessage] = []
    run_bytes = 0
    for message in messages:
        if run and not _joins(run, run_bytes, message, max_chunk_bytes):
            out.append((run[0].lane, chunks_frame(run)))
            run, run_bytes = [], 0
        if message.kind == "chunk":
            run.append(message)
            run_bytes += len(message.body)
        else:
            out.append((message.lane, message_to_frame(message, first_token)))
    if run:
        out.append((run[0].lane, chunks_frame(run)))
    return out


def _joins(run: list[KVMessage], run_bytes: int, message: KVMessage, max_chunk_bytes: int) -> bool:
    head = run[0]
    return (
        message.kind == "chunk"
        and message.lane == head.lane
        and message.header.get("handoff_id") == head.header.get("handoff_id")
        and len(run) < FRAME_MAX_CHUNKS
        and run_bytes + len(message.body) <= max_chunk_bytes
    )


def chunk_headers(header: dict[str, Any]) -> list[Any]:
    """The chunk headers a KV_CHUNK frame header carries (raw, unchecked beyond the list)."""
    chunks = header.get(CHUNKS_KEY)
    if chunks is None:
        return [header]
    if not isinstance(chunks, list) or not 1 <= len(chunks) <= _RECEIVE_MAX_CHUNKS:
        raise MalformedHandoff(f"KV_CHUNK {CHUNKS_KEY} must list 1..{_RECEIVE_MAX_CHUNKS} chunks")
    return chunks


def declared_sizes(chunks: list[Any]) -> list[int] | None:
    """Each chunk's declared ``nbytes``, or None when one is missing or not a size."""
    sizes = [c.get("nbytes") if isinstance(c, dict) else None for c in chunks]
    if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
        return sizes  # type: ignore[return-value]
    return None


Place = memoryview | list[memoryview] | LandedDecode | None


def chunk_destinations(
    place: Callable[[Any], Place], header: dict[str, Any], n_bytes: int, checksums: bool = True,
) -> memoryview | BodyParts | None:
    """A body sink's answer for a KV_CHUNK frame: ``place(chunk header)`` for each chunk.

    A raw chunk lands in its rows (in per-head pieces where its layer's buffer has room:
    ``groups`` says how many parts each chunk took); a coded one in its ``LandedDecode``'s buffer,
    decoded by the link's bulk thread as soon as it is in. Chunks without a
    place get fresh buffers of their own; None when no chunk has a place or the
    header does not describe the body (the frame's feed then refuses it). The
    parts ask for ``checksums`` (not for a handoff without them: ``checksum_of =
    "none"``), which ``frame_to_messages`` hands on as each chunk's ``body_crc``.
    """
    try:
        chunks = chunk_headers(header)
    except MalformedHandoff:
        return None
    sizes = declared_sizes(chunks)
    if sizes is None or sum(sizes) != n_bytes:
        return None
    places = [place(chunk) for chunk in chunks]
    if all(p is None for p in places):
        return None
    pieces = [_views_of(p, size) for p, size in zip(places, sizes, strict=True)]
    views = [view for chunk in pieces for view in chunk]
    groups = [len(chunk) for chunk in pieces]
    starts = [sum(groups[:i]) for i in range(len(groups))]  # a chunk's first part
    decodes = {starts[i]: p for i, p in enumerate(places) if isinstance(p, LandedDecode)}
    landed = (lambda index: decodes[index]() if index in decodes else None) if decodes else None
    # The bulk channel takes each chunk's crc32 as it lands, so no pass re-reads the bytes.
    return BodyParts(views, checksums=checksums, landed=landed,
                     groups=groups if len(views) > len(pieces) else None)


def _views_of(place: Place, size: int) -> list[memoryview]:
    views = [place.body] if isinstance(place, LandedDecode) else place
    views = [views] if isinstance(views, memoryview) else views
    if views is None or sum(len(v) for v in views) != size:
        return [memoryview(bytearray(size))]
    return views


def frame_to_messages(frame: Frame) -> list[KVMessage]:
    """The KV messages a frame carries: one, or each chunk of a joined KV_CHUNK frame."""
    kind = TYPE_TO_KIND.get(frame.type)
    if kind is None:
        raise MalformedHandoff(f"{frame.type.name} is not a KV frame")
    if kind != "chunk":
        return [KVMessage(kind, frame.header, frame.body)]
    if CHUNKS_KEY not in frame.header:  # one chunk: its body as it came (the assembler checks it)
        chunks, bodies = [frame.header], [_one_body(frame.body)]
    else:
        chunks = chunk_headers(frame.header)
        bodies = _split_body(frame.body, declared_sizes(chunks))
    crcs = _landed_crcs(frame.body, bodies)
    return [
        KVMessage("chunk", chunk, body, body_crc=crc)
        for chunk, body, crc in zip(chunks, bodies, crcs, strict=True)
    ]


def _landed_crcs(body: Body, bodies: list[Body]) -> list[int | None]:
    """Each chunk's crc32 as the link took it, when it scattered the body chunk by chunk."""
    if isinstance(body, BodyParts) and body.crcs is not None and len(body.crcs) == len(bodies):
        return list(body.crcs)
    return [None] * len(bodies)


def _one_body(body: Body) -> Body:
    if isinstance(body, BodyParts) and body.groups is not None and len(body.groups) == 1:
        return _grouped(body)[0]  # one chunk in per-head pieces: in place as it is
    if isinstance(body, BodyParts):
        return body.views[0] if len(body.views) == 1 else bytes(body)
    return body


def _split_body(body: Body, sizes: list[int] | None) -> list[Body]:
    if sizes is None or sum(sizes) != len(body):
        raise MalformedHandoff("KV_CHUNK chunk sizes do not add up to the frame body")
    if isinstance(body, BodyParts) and body.groups is not None:
        grouped = _grouped(body)
        if [len(chunk) for chunk in grouped] == sizes:
            return grouped  # scattered by the body sink, some chunks over per-head pieces
    if isinstance(body, BodyParts) and [len(v) for v in body.views] == sizes:
        return list(body.views)  # scattered by the body sink, one buffer per chunk
    view = memoryview(bytes(body) if isinstance(body, BodyParts) else body)
    out, at = [], 0
    for size in sizes:
        out.append(view[at : at + size])
        at += size
    return out


def _grouped(body: BodyParts) -> list[Body]:
    """Each chunk's body from the parts the sink gave it: one view, or the pieces as parts."""
    out, at = [], 0
    for count in body.groups or ():
        views = body.views[at : at + count]
        out.append(views[0] if count == 1 else BodyParts(views))
        at += count
    return out


def end_first_token(frame: Frame) -> int | None:
    """The first token a KV_END frame carries, or None (then the begin header's counts)."""
    value = frame.header.get(FIRST_TOKEN_KEY)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise MalformedHandoff("KV_END first_token must be a token id")
    return value


# A node announces the handoff serde versions it takes in its link verdict
# (``Link.peer_announce``), so a sender uses a newer format only towards peers that read it.
KV_SERDE_ANNOUNCE = "kv_serde"


def announce_serde_versions() -> str:
    return ",".join(str(version) for version in SUPPORTED_SERDE_VERSIONS)


def announced_serde_versions(announce: Mapping[str, str]) -> frozenset[int]:
    """The versions a peer announced; none from a peer older than the announcement."""
    found = set()
    for part in announce.get(KV_SERDE_ANNOUNCE, "").split(",")[:16]:
        if part.strip().isdigit():
            found.add(int(part))
    return frozenset(found)
