"""Frame bodies as a link handles them: flat byte buffers out, sink buffers in.

A body to send may be any C-contiguous buffer; the link flattens it so ``len()``
is its byte count. A received bulk body may be decrypted into a buffer the
consumer's body sink names (the KV receiver points it at the layer buffer, so a
body is written once); a buffer of the wrong size, read-only or not contiguous
is ignored with a warning and the body lands in a fresh one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mlxcel_plugin.link.protocol.frames import BodyParts, Frame, FrameType
from mlxcel_plugin.link.protocol.record_reader import BulkBody

logger = logging.getLogger("mlxcel_plugin.link")

# (frame type, frame header, body length) -> a writable C-contiguous byte buffer of exactly
# that length to decrypt the body into (or a BodyParts of such buffers to scatter it over),
# or None for a fresh one. Called on the event loop when the body is announced, before it
# is read; must not raise.
BodySink = Callable[[FrameType, dict, int], memoryview | BodyParts | None]


def sink_buffer(
    sink: BodySink | None, bulk: BulkBody, name: str = ""
) -> memoryview | BodyParts | None:
    """Where ``sink`` wants ``bulk``'s body: a byte view or BodyParts; None for a fresh buffer."""
    if sink is None:
        return None
    try:
        frame_type = FrameType(bulk.type_code)
    except ValueError:
        return None
    into = sink(frame_type, bulk.header, bulk.n_bytes)
    if into is None:
        return None
    views = into.views if isinstance(into, BodyParts) else (memoryview(into),)
    if len(into) != bulk.n_bytes or not all(_writable_bytes(v) for v in views):
        logger.warning("link %s: body sink gave an unusable buffer for %d bytes; ignored",
                       name, bulk.n_bytes)
        return None
    return into if isinstance(into, BodyParts) else views[0].cast("B")


def flat_body(frame: Frame) -> Frame:
    """Bodies as flat byte buffers, so len() is the byte count (numpy arrays aren't)."""
    if isinstance(frame.body, bytes | bytearray | BodyParts):
        return frame
    view = memoryview(frame.body)
    if view.format == "B" and view.ndim == 1:
        return frame
    return Frame(frame.type, frame.header, view.cast("B"))


def _writable_bytes(view: memoryview) -> bool:
    return not view.readonly and view.c_contiguous
