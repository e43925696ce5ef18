"""Bulk lanes over real sockets on 127.0.0.1: bodies spread over N lanes land intact and in
order, lanes have their own keys, a dropped lane fails the link with a named error, and
peers asking different lane counts (or none) interoperate."""

import asyncio
import dataclasses
import os
import socket

import pytest

from mlxcel_plugin.link import LinkConfig, dial_link, serve_links
from mlxcel_plugin.link.bulk_attach import BulkLanesRefused
from mlxcel_plugin.link.protocol import handshake
from mlxcel_plugin.link.protocol.frames import BodyParts, Frame, FrameType, encode_header
from mlxcel_plugin.link.protocol.handshake import (
    MAX_BULK_LANES,
    ClientHandshake,
    ServerHandshake,
)
from mlxcel_plugin.link.protocol.record_reader import (
    KIND_BULK,
    KIND_BULK_LANE,
    RecordReader,
    bulk_record,
)
from mlxcel_plugin.link.protocol.records import RecordAuthError
from mlxcel_plugin.link.read_load import ReadLoad

SECRET = bytes(range(32))
KIB = 1024
RECORD = 64 * KIB  # small records: many per body, bodies cut mid-record
pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 40))


def lanes_config(asked: int = 1, granted: int = 4) -> LinkConfig:
    return LinkConfig(bulk_lanes=asked, bulk_max_lanes=granted, bulk_chunk_bytes=RECORD)


async def collect(into: list, kinds: list | None = None):
    """An on_link handler queueing each link and its frames (and, where asked, the record
    kinds it reads)."""
    async def on_link(link):
        into.append(link)
        if kinds is not None:
            feed = link._records.feed
            link._records.feed = lambda plain: kinds.append(plain[0]) or feed(plain)
        async for frame in link:
            into.append(frame)
    return on_link


async def serve(on_link, config: LinkConfig):
    return await serve_links("127.0.0.1:0", SECRET, "decode", "d1", {"prefill"}, on_link,
                             config=config)


async def wait_for(check, what: str, timeout_s: float = 20.0):
    async with asyncio.timeout(timeout_s):
        while not check():  # polled until true or the deadline
            await asyncio.sleep(0.01)
    return what


SIZES = (0, 1, RECORD - 1, RECORD, RECORD + 1, 3 * RECORD + 17, 5 * 1024 * KIB + 3, 7, 100_000)


@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_bodies_arrive_identical_and_in_order_over_lanes(lanes):
    async def main():
        got: list = []
        async with await serve(await collect(got), lanes_config(granted=4)) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1",
                                   config=lanes_config(asked=lanes))
            bodies = [os.urandom(n) for n in SIZES]
            parts = [os.urandom(n) for n in (RECORD - 5, 0, 2 * RECORD + 9, 3)]
            for i, body in enumerate(bodies):
                await link.send(Frame(FrameType.KV_CHUNK, {"i": i}, body))
            await link.send(Frame(FrameType.KV_CHUNK, {"i": "parts"}, BodyParts(parts)))
            await wait_for(lambda: len(got) == len(bodies) + 2, "all frames")
            served, frames = got[0], got[1:]
            assert (link.bulk_lanes, served.bulk_lanes) == (lanes, lanes)
            assert [f.header["i"] for f in frames] == [*range(len(bodies)), "parts"]
            assert [bytes(f.body) for f in frames] == [*bodies, b"".join(parts)]
            # Every lane carried records (the bodies were spread, not all on lane 0).
            assert all(c._receiver.seq > 0 for c in served._bulk.channels)
            # The readers' load covers every body they read; the dialer's read none.
            assert served.bulk_read_load().wall_s > 0 and served.bulk_read_load().busy_s > 0
            assert link.bulk_read_load() == ReadLoad()
            await link.close()

    run(main())


def test_bodies_over_four_lanes_land_in_the_sinks_buffers():
    async def main():
        sizes = [RECORD * 3 + 5, 1, 2 * RECORD, RECORD - 1] * 2
        landing = [bytearray(n) for n in sizes]
        got: list = []

        async def on_link(link):
            link.set_body_sink(lambda _t, header, _n: memoryview(landing[header["i"]]))
            await (await collect(got))(link)

        async with await serve(on_link, lanes_config(granted=4)) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1",
                                   config=lanes_config(asked=4))
            bodies = [os.urandom(n) for n in sizes]
            for i, body in enumerate(bodies):
                await link.send(Frame(FrameType.KV_CHUNK, {"i": i}, body))
            await wait_for(lambda: len(got) == len(bodies) + 1, "all frames")
            assert [bytes(b) for b in landing] == bodies
            assert [f.header["i"] for f in got[1:]] == list(range(len(bodies)))
            await link.close()

    run(main())


# ---------------------------------------------------------------- keys


def _handshake_pair(asked: int = 4):
    client = ClientHandshake(SECRET, "prefill", "p1", want_bulk=True, bulk_lanes=asked)
    server = ServerHandshake(SECRET, "decode", "d1", {"prefill"})
    finished = client.receive(server.receive(client.start()))
    client.receive(server.receive(finished))
    return client, server


def test_each_lane_and_direction_has_its_own_key_and_nonce_prefix():
    client, server = _handshake_pair()
    assert server.peer.bulk_lanes == 4
    directions = []
    for lane in range(MAX_BULK_LANES):
        sender, receiver = client.session.bulk_records(RECORD, lane)
        directions += [(sender._key, sender._iv_prefix), (receiver._key, receiver._iv_prefix)]
    assert len({key for key, _ in directions}) == len(directions)  # no key on two lanes
    assert len({(key, iv) for key, iv in directions}) == len(directions)


def test_a_record_sealed_for_one_lane_opens_only_on_that_lane():
    client, server = _handshake_pair()
    record = bytearray(100 + 16)
    client.session.bulk_records(RECORD, 2)[0].seal_into(b"x" * 100, record)
    assert server.session.bulk_records(RECORD, 2)[1].open(record) == b"x" * 100
    for lane in (0, 1, 3):
        with pytest.raises(RecordAuthError):
            server.session.bulk_records(RECORD, lane)[1].open(record)


def test_a_bulk_record_naming_a_lane_the_link_lacks_is_refused():
    reader = RecordReader(1 << 20, bulk=True, lanes=2)
    header = encode_header(FrameType.KV_CHUNK, {})
    (body,) = reader.feed(bulk_record(10, header, lane=1))
    assert (body.lane, body.n_bytes) == (1, 10)
    with pytest.raises(Exception, match="lane 2 of 2"):
        reader.feed(bulk_record(10, header, lane=2))


# ---------------------------------------------------------------- negotiation


@pytest.mark.parametrize(("asked", "granted", "lanes"), [(1, 4, 1), (4, 1, 1), (4, 2, 2),
                                                         (4, 4, 4)])
def test_peers_asking_different_lane_counts_interoperate(asked, granted, lanes):
    async def main():
        got, kinds = [], []
        async with await serve(await collect(got, kinds), lanes_config(granted=granted)) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1",
                                   config=lanes_config(asked=asked))
            bodies = [os.urandom(n) for n in (3 * RECORD, 10, RECORD + 1, 2 * RECORD)]
            for i, body in enumerate(bodies):
                await link.send(Frame(FrameType.KV_CHUNK, {"i": i}, body))
            await wait_for(lambda: len(got) == len(bodies) + 1, "all frames")
            assert (link.bulk_lanes, got[0].bulk_lanes) == (lanes, lanes)
            assert [bytes(f.body) for f in got[1:]] == bodies
            # A one-lane link announces bodies as peers without lanes read them.
            bulk_kinds = {k for k in kinds if k in (KIND_BULK, KIND_BULK_LANE)}
            assert bulk_kinds == ({KIND_BULK} if lanes == 1 else {KIND_BULK_LANE})
            await link.close()

    run(main())


def test_a_peer_granting_more_lanes_than_asked_is_refused(monkeypatch):
    # The server is made to read every ask as 4 lanes; the client asked for 2.
    monkeypatch.setattr(handshake, "lanes_from_flags", lambda flags: 4)

    async def main():
        # The server waits for lanes that never come until its handshake deadline.
        config = dataclasses.replace(lanes_config(granted=4), handshake_timeout_s=1.0)
        async with await serve(await collect([]), config) as server:
            with pytest.raises(BulkLanesRefused, match="4 bulk lanes, more than the 2 asked"):
                await dial_link(server.address, SECRET, "prefill", "p1",
                                config=lanes_config(asked=2))

    run(main())


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_a_lane_dropped_mid_body_fails_the_link_with_a_named_error(side):
    async def main():
        got: list = []
        served: list = []
        client_link: list = []

        def drop_a_lane(index):  # on the receiving lane thread, once a part is in
            if index:
                return
            # The receiver's own lane: shut for reading only, so it (not the sender, whose
            # writes would else be reset) is the first to see the cut and names it.
            if side == "receiver":
                served[0]._bulk.channels[1]._sock.shutdown(socket.SHUT_RD)
            else:
                client_link[0]._bulk.channels[1]._sock.shutdown(socket.SHUT_RDWR)

        async def on_link(link):
            served.append(link)
            link.set_body_sink(lambda _t, header, n: BodyParts(
                [bytearray(RECORD), bytearray(n - RECORD)],
                landed=drop_a_lane if header["i"] == 1 else None))
            await (await collect(got))(link)

        async with await serve(on_link, lanes_config(granted=2)) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1",
                                   config=lanes_config(asked=2))
            client_link.append(link)
            await link.send(Frame(FrameType.KV_CHUNK, {"i": 0}, os.urandom(2 * RECORD)))
            # Lane 1, dropped after its first record: more than socket buffers hold.
            body = os.urandom(1024 * RECORD)
            await link.send(Frame(FrameType.KV_CHUNK, {"i": 1}, body))
            await wait_for(lambda: link.closed and served and served[0].closed, "both closed")
            assert served[0].error is not None and served[0].error.code == "bulk_channel"
            assert "closed in the middle of a body" in served[0].error.message
            assert [f.header["i"] for f in got[1:]] == [0]  # the cut body never reaches the app

    run(main())


# ---------------------------------------------------------------- threads


def test_bulk_records_are_sealed_and_opened_only_in_lane_threads(monkeypatch):
    import threading

    from mlxcel_plugin.link.bulk import BULK_IN_THREAD, BULK_OUT_THREAD
    from mlxcel_plugin.link.protocol.records import RecordReceiver, RecordSender

    seen: dict[str, set[str]] = {"seal": set(), "open": set()}

    def spy(cls, name, kind):
        real = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            if self._label.startswith(b"mlxcel bulk"):  # not the WebSocket's records
                seen[kind].add(threading.current_thread().name)
            return real(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, wrapped)

    for name in ("seal_into", "seal_parts_into"):
        spy(RecordSender, name, "seal")
    for name in ("open_into", "open_parts_into"):
        spy(RecordReceiver, name, "open")

    async def main():
        got: list = []
        async with await serve(await collect(got), lanes_config(granted=2)) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1",
                                   config=lanes_config(asked=2))
            parts = [os.urandom(RECORD + 3), os.urandom(5)]
            await link.send(Frame(FrameType.KV_CHUNK, {"i": 0}, os.urandom(3 * RECORD)))
            await link.send(Frame(FrameType.KV_CHUNK, {"i": 1}, BodyParts(parts)))
            await wait_for(lambda: len(got) == 3, "both frames")
            await link.close()

    run(main())
    assert seen["seal"] and all(n.startswith(BULK_OUT_THREAD) for n in seen["seal"])
    assert seen["open"] and all(n.startswith(BULK_IN_THREAD) for n in seen["open"])
    assert {n.split("_")[0] for n in seen["open"]} == {BULK_IN_THREAD + "0", BULK_IN_THREAD + "1"}


def test_bodies_larger_than_the_send_budget_go_out_on_every_lane_at_once(monkeypatch):
    """A body's budget comes back once it is on the socket, and a KV frame is larger than the
    budget: the lanes must still write side by side, not take turns. Each lane's writer
    waits at a barrier inside its write until the other lane's arrives: taking turns, the
    first would wait there alone and its link fail."""
    import threading

    from mlxcel_plugin.link.bulk import BulkChannel

    barrier = threading.Barrier(2, timeout=15)
    real_write = BulkChannel.write_body

    def write_side_by_side(self, body):
        if len(body) > RECORD:  # the two big bodies; not small frames
            barrier.wait()
        return real_write(self, body)

    monkeypatch.setattr(BulkChannel, "write_body", write_side_by_side)

    async def main():
        got: list = []
        config = dataclasses.replace(lanes_config(asked=2, granted=2),
                                     send_queue_bytes=2 * RECORD)
        async with await serve(await collect(got), config) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1", config=config)
            bodies = [os.urandom(3 * RECORD), os.urandom(3 * RECORD + 1)]
            for i, body in enumerate(bodies):
                await link.send(Frame(FrameType.KV_CHUNK, {"i": i}, body))
            await wait_for(lambda: len(got) == 3, "both frames")
            assert [bytes(f.body) for f in got[1:]] == bodies
            await link.close()

    run(main())
    assert not barrier.broken
