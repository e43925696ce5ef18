"""The bulk channel tells a body's parts as they land, and only once their records authenticate.

A receiver decodes a coded KV chunk on the bulk thread when its part has
landed (``BodyParts.landed``); a tampered or reordered record must fail the
body with a named error before any part it carries is announced.
"""

from __future__ import annotations

import os
import socket

import pytest

from mlxcel_plugin.link.bulk import BulkChannel
from mlxcel_plugin.link.protocol.body_parts import BodyParts
from mlxcel_plugin.link.protocol.records import (
    TAG_BYTES,
    RecordAuthError,
    RecordReceiver,
    RecordSender,
)

KEY, IV, LABEL = bytes(range(32)), b"\x01\x02\x03\x04", b"test bulk"
RECORD = 1024
BODY = os.urandom(3000)  # three records: 1024, 1024, 952 bytes
PARTS = (1000, 1000, 1000)  # part 0 ends in record 0, part 1 in record 1, part 2 in record 2


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback TCP connection (the channel tunes TCP options)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def sealed_records() -> list[bytes]:
    sender = RecordSender(KEY, IV, LABEL, max_record_bytes=RECORD)
    a, b = tcp_pair()
    with a, b:
        BulkChannel(a, sender, RecordReceiver(KEY, IV, LABEL), RECORD, 5).write_body(BODY)
        wire = b""
        while len(wire) < len(BODY) + 3 * TAG_BYTES:  # bounded: exactly what was written
            wire += b.recv(65536)
    sizes = [RECORD + TAG_BYTES, RECORD + TAG_BYTES, len(BODY) - 2 * RECORD + TAG_BYTES]
    records, at = [], 0
    for size in sizes:
        records.append(wire[at : at + size])
        at += size
    return records


def receive(records: list[bytes]) -> tuple[list[int], BodyParts, BaseException | None]:
    landed: list[int] = []
    parts = BodyParts([bytearray(n) for n in PARTS], landed=landed.append)
    c, d = tcp_pair()
    with c, d:
        c.sendall(b"".join(records))
        channel = BulkChannel(d, RecordSender(KEY, IV, LABEL), RecordReceiver(KEY, IV, LABEL),
                              RECORD, 5)
        try:
            channel.read_body(len(BODY), parts)
        except RecordAuthError as exc:
            return landed, parts, exc
    return landed, parts, None


def test_each_part_is_announced_once_its_last_record_is_in():
    landed, parts, error = receive(sealed_records())
    assert error is None and landed == [0, 1, 2]
    assert bytes(parts) == BODY


@pytest.mark.parametrize("damage", ["tampered", "reordered"])
def test_a_bad_record_fails_the_body_before_its_parts_are_announced(damage):
    records = sealed_records()
    if damage == "tampered":
        record = bytearray(records[1])
        record[7] ^= 0x01
        records[1] = bytes(record)
    else:
        records[0], records[1] = records[1], records[0]
    landed, _, error = receive(records)
    assert isinstance(error, RecordAuthError) and error.code == "record_auth_failed"
    assert landed == ([0] if damage == "tampered" else [])  # nothing from the bad record on
