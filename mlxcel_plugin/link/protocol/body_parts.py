"""A frame body given as several buffers (``BodyParts``): gather on send, scatter on receive."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class BodyParts:
    """A body made of several byte buffers, sent and received back to back without joining.

    Why: one frame for many KV chunks (each a slice of its own tensor) saves a
    frame's bookkeeping per chunk on both ends; the bulk channel seals and
    opens records straight across the parts. ``len`` is the total byte count
    and ``bytes()`` joins them, so code that needs one buffer still gets it.

    A receiver's body sink may ask for ``checksums``: the bulk channel then
    fills ``crcs`` with each part's crc32 as it decrypts into it, while the
    bytes are still in cache (a later pass over cold memory costs ~2.5x).

    ``landed(index)``, where given, is called on the bulk channel's thread once
    every byte of part ``index`` is in and authenticated: a receiver decodes a
    compressed or quantized part there, off the event loop, while later records
    still arrive. It must not raise.

    ``groups``, where given, says how many consecutive parts make each item the frame
    carries (a KV chunk landing in per-head pieces is several parts): the receiver's own
    bookkeeping, never sent.
    """

    __slots__ = ("views", "nbytes", "checksums", "crcs", "landed", "groups")

    def __init__(self, buffers: Sequence[bytes | bytearray | memoryview], checksums: bool = False,
                 landed: Callable[[int], None] | None = None,
                 groups: Sequence[int] | None = None):
        # A flat byte view is kept as the very object given, so a receiver can tell its own
        # destination views by identity (kv_serde.chunk_body.occupies).
        views = tuple(buffers)
        if not all(map(_flat, views)):
            views = tuple(b if _flat(b) else memoryview(b).cast("B") for b in views)
        self.views = views
        self.nbytes = sum(map(len, views))
        self.checksums = checksums
        self.crcs: list[int] | None = None  # set by the bulk channel once every part is in
        self.landed = landed
        self.groups = tuple(groups) if groups is not None else None

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.views)


def _flat(buffer: object) -> bool:
    return type(buffer) is memoryview and buffer.format == "B" and buffer.ndim == 1
