"""A peer that holds the cluster secret and breaks the rules: for hardening tests.

It dials like any node (``dial_link``), then writes what a well-behaved
``Link`` never would: BULK announcements whose bodies never come, frames that
the typed constructors refuse to build, junk before the handshake. The
nodes' answers are read with the ordinary ``Link`` API.
"""

from __future__ import annotations

import asyncio
import socket

from mlxcel_plugin.link import Link
from mlxcel_plugin.link.protocol.frames import Frame, FrameType, encode_header, pack_token_ids
from mlxcel_plugin.link.protocol.record_reader import bulk_record


async def send_record(link: Link, plaintext: bytes) -> None:
    """Seal and send one link record past the link's writer (which must be idle)."""
    await link.drain()
    await link._ws.send(link._session.sender.seal(plaintext))


async def announce_bulk_body(link: Link, n_bytes: int,
                             frame_type: FrameType = FrameType.KV_CHUNK) -> None:
    """A BULK record declaring ``n_bytes`` of body that is never sent."""
    header = {"handoff_id": "no-such-handoff", "epoch": 0}
    await send_record(link, bulk_record(n_bytes, encode_header(frame_type, header)))


def raw_request(request_id: str, prompt: list[int], **header: object) -> Frame:
    """A REQUEST frame built field by field (``Request.to_frame`` would refuse bad values)."""
    fields = {"request_id": request_id, "max_tokens": 4, **header}
    return Frame(FrameType.REQUEST, fields, pack_token_ids(prompt))


async def send_junk(address: str, junk: bytes, count: int) -> None:
    """``count`` TCP connections that each send ``junk`` and hang up (no secret needed)."""
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    for _ in range(count):  # bounded by count
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, int(port)))
            await loop.sock_sendall(sock, junk)
            await asyncio.sleep(0.005)  # let the server read it before the hang-up
        finally:
            sock.close()
