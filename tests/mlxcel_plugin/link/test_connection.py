"""Link tests over real sockets on 127.0.0.1 (one process, and two processes)."""

import asyncio
import gc
import logging
import os
import subprocess
import sys
import weakref
import zlib
from pathlib import Path

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from mlxcel_plugin.link import (
    Backoff,
    LinkClosed,
    LinkConfig,
    dial_link,
    dial_with_backoff,
    serve_links,
)
from mlxcel_plugin.link.bulk import BULK_IN_THREAD, record_spans
from mlxcel_plugin.link.protocol.frames import (
    BodyParts,
    Frame,
    FrameType,
    MalformedFrame,
    Ping,
    Request,
    Result,
    decode_frame,
)
from mlxcel_plugin.link.protocol.handshake import ClientHandshake
from mlxcel_plugin.link.protocol.handshake_messages import BadMac, PeerAtCapacity, RoleRefused
from mlxcel_plugin.link.protocol.record_reader import KIND_BATCH, KIND_FRAME, split_batch

SECRET = bytes(range(32))
WRONG = bytes(range(100, 132))
MIB = 1024 * 1024
pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def echo(link):
    async for frame in link:
        await link.send(frame)


async def serve(on_link=echo, **kw):
    kw.setdefault("accept_roles", {"prefill", "router"})
    return await serve_links("127.0.0.1:0", SECRET, "decode", "d1", on_link=on_link, **kw)


def test_echo_small_frames_and_ping():
    async def main():
        async with await serve() as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            assert (link.peer_role, link.peer_node_id, link.has_bulk) == ("decode", "d1", True)
            request = Request("r1", list(range(1000)), {"temperature": 0.0}, 8, [2], None)
            await link.send(request.to_frame())
            assert Request.from_frame(await link.recv()) == request
            await link.send(Ping(9, 1.0).to_frame())
            pong = await link.recv()
            assert pong.type is FrameType.PONG and Ping.from_frame(pong).nonce == 9
            await link.close()
            with pytest.raises(LinkClosed):
                await link.send(Result("r1", 0).to_frame())

    run(main())


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "websocket-parts"])
def test_large_bodies_arrive_intact_and_in_order(bulk):
    async def main():
        config = LinkConfig(bulk=bulk, max_record_bytes=2 * MIB)
        async with await serve(config=config) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1", config=config)
            assert link.has_bulk is bulk
            bodies = [os.urandom(n) for n in (5 * MIB + 3, 10, 300_000, 2 * MIB)]
            for i, body in enumerate(bodies):
                await link.send(Frame(FrameType.KV_CHUNK, {"i": i}, body))
            for i, body in enumerate(bodies):
                frame = await link.recv()
                assert frame.header == {"i": i} and bytes(frame.body) == body
            await link.close()

    run(main())


def test_a_body_sink_receives_bulk_bodies_in_its_own_buffer():
    async def main():
        received = asyncio.Queue()
        buffers = {0: bytearray(MIB), 1: bytearray(MIB)}
        offered = []

        def sink(frame_type, header, n_bytes):
            offered.append((frame_type, header["i"], n_bytes))
            buf = buffers.get(header["i"])
            return None if buf is None else memoryview(buf)

        async def take(link):
            link.set_body_sink(sink)
            async for frame in link:
                await received.put(frame)

        async with await serve(on_link=take) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            bodies = [os.urandom(MIB), os.urandom(MIB), os.urandom(MIB), b"small"]
            for i, body in enumerate(bodies):
                await link.send(Frame(FrameType.KV_CHUNK, {"i": i}, body))
            frames = [await received.get() for _ in bodies]
            assert [bytes(f.body) for f in frames] == bodies
            assert bytes(buffers[0]) == bodies[0] and bytes(buffers[1]) == bodies[1]
            # Every KV chunk's body goes on the bulk channel, the 5-byte one too (none over
            # the WebSocket), and so is offered to the sink; i=2 and 3 got fresh buffers.
            sizes = [MIB, MIB, MIB, 5]
            assert offered == [(FrameType.KV_CHUNK, i, n) for i, n in enumerate(sizes)]
            await link.close()

    run(main())


def test_record_spans_cut_parts_into_records_of_the_record_size():
    views = [memoryview(bytes(n)) for n in (5, 0, 2, 9)]
    spans = [[(i, len(piece)) for i, piece in pieces] for pieces in record_spans(views, 4)]
    assert spans == [[(0, 4)], [(0, 1), (2, 2), (3, 1)], [(3, 4)], [(3, 4)]]
    assert list(record_spans([memoryview(b"")], 4)) == []


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "websocket-parts"])
def test_a_body_in_parts_is_gathered_and_scattered_across_record_boundaries(bulk):
    async def main():
        # Parts straddle the 1 MiB bulk records (and the 2 MiB WebSocket records).
        sizes = (MIB - 5, 10, 3 * MIB + 7, 5)
        parts = [os.urandom(n) for n in sizes]
        landing = [bytearray(n) for n in sizes]
        received = asyncio.Queue()

        async def take(link):
            link.set_body_sink(
                lambda *_: BodyParts([memoryview(b) for b in landing], checksums=True)
            )
            async for frame in link:
                await received.put(frame)

        config = LinkConfig(bulk=bulk, max_record_bytes=2 * MIB)
        async with await serve(on_link=take, config=config) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1", config=config)
            await link.send(Frame(FrameType.KV_CHUNK, {"n": 4}, BodyParts(parts)))
            await link.send(Frame(FrameType.KV_CHUNK, {"n": 1}, b"after"))
            frame = await received.get()
            assert bytes(frame.body) == b"".join(parts) and len(frame.body) == sum(sizes)
            if bulk:  # the sink's buffers got the bytes, part by part, and their crc32s
                assert isinstance(frame.body, BodyParts)
                assert [bytes(b) for b in landing] == parts
                assert frame.body.crcs == [zlib.crc32(p) for p in parts]
            assert bytes((await received.get()).body) == b"after"
            await link.close()

    run(main())


def test_a_sink_buffer_of_the_wrong_size_is_ignored(caplog):
    async def main():
        received = asyncio.Queue()

        async def take(link):
            link.set_body_sink(lambda *_: memoryview(bytearray(10)))
            async for frame in link:
                await received.put(frame)

        async with await serve(on_link=take) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            body = os.urandom(MIB)
            await link.send(Frame(FrameType.KV_CHUNK, {}, body))
            assert bytes((await received.get()).body) == body
            await link.close()

    with caplog.at_level(logging.WARNING):
        run(main())
    assert "unusable buffer" in caplog.text


def test_wrong_secret_is_refused_and_logged_without_the_secret(caplog):
    async def main():
        async with await serve() as server:
            with pytest.raises(BadMac):
                await dial_link(server.address, WRONG, "prefill", "p1")

    with caplog.at_level(logging.WARNING, logger="mlxcel_plugin.link"):
        run(main())
    text = caplog.text
    assert "p1" in text and "127.0.0.1" in text
    assert SECRET.hex() not in text and WRONG.hex() not in text


def test_wrong_role_is_refused():
    async def main():
        async with await serve(accept_roles={"prefill"}) as server:
            with pytest.raises(RoleRefused):
                await dial_link(server.address, SECRET, "router", "r1")

    run(main())


def test_connection_limit_gives_at_capacity_with_retry_after():
    async def main():
        async with await serve(max_links=1, retry_after_s=0.05) as server:
            first = await dial_link(server.address, SECRET, "prefill", "p1")
            with pytest.raises(PeerAtCapacity) as info:
                await dial_link(server.address, SECRET, "prefill", "p2")
            assert info.value.retry_after_s == 0.05
            await first.close()
            # Backoff honours retry-after, then gets in once the slot is free.
            slept = []

            async def sleep(s):
                slept.append(s)
                await asyncio.sleep(s)

            second = await dial_with_backoff(server.address, SECRET, "prefill", "p2",
                                             backoff=Backoff(initial_s=0.01), sleep=sleep)
            assert second.peer_node_id == "d1"
            await second.close()

    run(main())


def test_stalled_handshake_is_dropped_at_the_deadline():
    async def main():
        config = LinkConfig(handshake_timeout_s=0.3)
        async with await serve(config=config) as server:
            ws = await connect(f"ws://{server.address}/link", compression=None, proxy=None)
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(ConnectionClosed) as info:
                await ws.recv()  # we never send HELLO
            assert loop.time() - start < 2.0
            assert info.value.rcvd.code == 1008

    run(main())


def test_tampered_record_closes_with_policy_violation(caplog):
    async def main():
        async with await serve(config=LinkConfig(bulk=False)) as server:
            ws = await connect(f"ws://{server.address}/link", compression=None, proxy=None)
            hs = ClientHandshake(SECRET, "prefill", "mallory")
            await ws.send(hs.start())
            await ws.send(hs.receive(await ws.recv()))
            hs.receive(await ws.recv())
            record = bytearray(hs.session.sender.seal(b"\x00" + b"x" * 20))
            record[3] ^= 0x40
            await ws.send(bytes(record))
            with pytest.raises(ConnectionClosed) as info:
                await ws.recv()
            assert info.value.rcvd.code == 1008

    with caplog.at_level(logging.WARNING, logger="mlxcel_plugin.link"):
        run(main())
    assert "mallory" in caplog.text and "127.0.0.1" in caplog.text


def test_send_waits_when_the_peer_does_not_read():
    async def main():
        never = asyncio.Event()

        async def sleepy(link):
            await never.wait()

        config = LinkConfig(bulk=False, send_queue_bytes=MIB, ws_max_queue=1, close_timeout_s=0.2)
        async with await serve(on_link=sleepy, config=config) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1", config=config)
            body = bytes(512 * 1024)
            sent = 0

            async def flood():
                nonlocal sent
                for _ in range(400):  # 200 MiB if nothing pushed back
                    await link.send(Frame(FrameType.KV_CHUNK, {}, body))
                    sent += 1

            with pytest.raises(TimeoutError):
                await asyncio.wait_for(flood(), 1.0)
            assert sent < 100  # bounded by the queue + socket buffers, not by the producer
            never.set()
            await link.close()

    run(main())


def test_two_processes_echo_over_real_sockets():
    script = Path(__file__).with_name("link_echo_server.py")
    proc = subprocess.Popen([sys.executable, str(script), SECRET.hex()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        async def main():
            link = await dial_link(f"127.0.0.1:{port}", SECRET, "router", "r1",
                                   expect_roles={"decode"})
            body = os.urandom(3 * MIB)
            await link.send(Frame(FrameType.KV_CHUNK, {"n": 1}, body))
            await link.send(Result("r", 1, [5, 6], "stop", 2).to_frame())
            assert bytes((await link.recv()).body) == body
            assert Result.from_frame(await link.recv()).token_ids == [5, 6]
            await link.close()

        run(main())
    finally:
        proc.stdin.close()  # the server exits at EOF on stdin
        proc.wait(timeout=10)
        proc.stdout.close()


def test_frames_sent_just_before_the_handler_returns_are_delivered():
    async def say_bye(link):
        await link.send(Result("r", 0, [1], "stop", 1).to_frame())
        await link.send(Frame(FrameType.KV_CHUNK, {}, bytes(MIB)))  # bulk path too

    async def main():
        async with await serve(on_link=say_bye) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            assert Result.from_frame(await link.recv()).finish_reason == "stop"
            assert len((await link.recv()).body) == MIB
            with pytest.raises(LinkClosed):
                await link.recv()

    run(main())


def test_numpy_like_buffers_are_sent_as_raw_bytes():
    import array

    async def main():
        async with await serve() as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            values = array.array("f", [1.5] * 100_000)  # 400 kB, a multi-byte item format
            await link.send(Frame(FrameType.KV_CHUNK, {}, values))
            assert bytes((await link.recv()).body) == values.tobytes()
            await link.close()

    run(main())


def test_concurrent_dials_never_overshoot_the_link_limit():
    async def main():
        async with await serve(max_links=2) as server:
            results = await asyncio.gather(
                *(dial_link(server.address, SECRET, "prefill", f"p{i}") for i in range(5)),
                return_exceptions=True)
            links = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, PeerAtCapacity)]
            assert (len(links), len(refused)) == (2, 3)
            for link in links:
                await link.close()

    run(main())


def test_bulk_port_refuses_an_unknown_token(caplog):
    async def main():
        async with await serve() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.bulk_port)
            writer.write(b"MLXB" + bytes(16) + bytes(32))
            assert await asyncio.wait_for(reader.read(100), 5) == b""  # closed, nothing said
            writer.close()

    with caplog.at_level(logging.WARNING, logger="mlxcel_plugin.link"):
        run(main())
    assert "unknown or already used bulk token" in caplog.text


async def raw_client(server, minor):
    """A hand-driven client: the records the server's link writes, opened one by one."""
    ws = await connect(f"ws://{server.address}/link", compression=None, proxy=None)
    hs = ClientHandshake(SECRET, "prefill", "raw", minor=minor)
    await ws.send(hs.start())
    await ws.send(hs.receive(await ws.recv()))
    hs.receive(await ws.recv())
    return ws, hs.session


@pytest.mark.parametrize("minor, batched", [(1, True), (0, False)], ids=["v1.1", "v1.0"])
def test_a_burst_of_small_frames_shares_records_with_peers_that_know_batches(minor, batched):
    burst = [Result(f"r{i}", i, [i]) for i in range(50)]

    async def send_burst(link):
        for result in burst:  # queued without yielding: the writer finds them all
            await link.send(result.to_frame())
        await link.drain()

    async def main():
        async with await serve(on_link=send_burst, config=LinkConfig(bulk=False)) as server:
            ws, session = await raw_client(server, minor)
            kinds, frames = [], []
            while len(frames) < len(burst):
                plain = memoryview(session.receiver.open(await ws.recv()))
                kinds.append(plain[0])
                views = split_batch(plain[1:]) if plain[0] == KIND_BATCH else [plain[1:]]
                frames += [Result.from_frame(decode_frame(view)) for view in views]
            await ws.close()
            return kinds, frames

    kinds, frames = run(main())
    assert frames == burst
    if batched:
        assert set(kinds) == {KIND_BATCH} and len(kinds) < len(burst)
    else:
        assert kinds == [KIND_FRAME] * len(burst)


def test_a_malformed_batch_record_closes_with_policy_violation():
    async def main():
        async with await serve(config=LinkConfig(bulk=False)) as server:
            ws, session = await raw_client(server, 1)
            await ws.send(session.sender.seal(bytes([KIND_BATCH]) + b"\x00\x00\x00\x09abc"))
            with pytest.raises(ConnectionClosed) as info:
                await ws.recv()
            assert info.value.rcvd.code == 1008

    run(main())


def test_deliver_to_hands_frames_in_order_including_those_queued_before():
    async def main():
        got = []

        async def send_ten(link):
            for i in range(10):
                await link.send(Result(f"r{i}", i, [i]).to_frame())
                if i == 4:
                    await asyncio.sleep(0.2)  # the first five are queued before deliver_to
            await link.drain()
            await link.wait_closed()

        async with await serve(on_link=send_ten) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            await asyncio.sleep(0.1)
            link.deliver_to(lambda frame: got.append(Result.from_frame(frame).request_id))
            for _ in range(100):  # bounded wait for the last five
                if len(got) == 10:
                    break
                await asyncio.sleep(0.02)
            await link.close()
        return got

    assert run(main()) == [f"r{i}" for i in range(10)]


@pytest.mark.parametrize(
    "failure, level, code, logged",
    [
        (MalformedFrame("not what this handler expects"), logging.WARNING, "frame_malformed",
         "not what this handler expects"),
        (KeyError("a bug in the app"), logging.ERROR, None, "frame handler failed"),
    ],
    ids=["protocol-error-1008", "bug-1011"],
)
def test_a_failing_handler_closes_its_link_and_says_why(caplog, failure, level, code, logged):
    async def main():
        async def send_one(link):
            await link.send(Result("r", 0, [1]).to_frame())
            await link.wait_closed()

        def handler(frame):
            raise failure

        async with await serve(on_link=send_one) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            link.deliver_to(handler)
            await asyncio.wait_for(link.wait_closed(), 5)
            return link

    with caplog.at_level(level, logger="mlxcel_plugin.link"):
        link = run(main())
    assert link.closed and (link.error.code if link.error else None) == code
    assert logged in caplog.text and "d1" in caplog.text


def test_deliver_to_handles_a_frame_before_the_next_record_is_read():
    """A body sink sees what the frame before its body set up (a KV begin, say)."""

    async def main():
        bodies = [os.urandom(MIB + i) for i in range(4)]
        begun, landed, order = set(), {}, []

        async def send_handoffs(link):
            for i, body in enumerate(bodies):
                await link.send(Frame(FrameType.KV_BEGIN, {"h": i}))
                await link.send(Frame(FrameType.KV_CHUNK, {"h": i}, body))
            await link.wait_closed()

        def sink(frame_type, header, n_bytes):
            if header["h"] not in begun:
                return None
            landed[header["h"]] = bytearray(n_bytes)
            return memoryview(landed[header["h"]])

        def handle(frame):
            order.append((frame.type, frame.header["h"]))
            if frame.type is FrameType.KV_BEGIN:
                begun.add(frame.header["h"])
            else:
                assert frame.body.obj is landed[frame.header["h"]]

        async with await serve(on_link=send_handoffs) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            link.set_body_sink(sink)
            link.deliver_to(handle)
            for _ in range(250):  # bounded wait for all eight frames
                if len(order) == 8:
                    break
                await asyncio.sleep(0.02)
            await link.close()
        return bodies, landed, order

    bodies, landed, order = run(main())
    assert order == [(t, i) for i in range(4) for t in (FrameType.KV_BEGIN, FrameType.KV_CHUNK)]
    assert [bytes(landed[i]) for i in range(4)] == bodies


def test_a_handled_frame_leaves_the_link_no_reference_to_its_body_buffer():
    """Once its handler returned, the link holds nothing of a frame: a decode node's receive
    buffers must be its adopted cache's alone, or MLX copies them at the first decode step
    instead of writing the token in place (the link kept its last bulk frame until the
    next one: the last 64 MiB frame of every handoff was copied)."""

    async def main():
        buffers, got = [], []

        async def send_one(link):
            await link.send(Frame(FrameType.KV_CHUNK, {"i": 0}, os.urandom(MIB)))
            await link.wait_closed()

        def sink(frame_type, header, n_bytes):
            buffer = np.empty(n_bytes, np.uint8)
            buffers.append(weakref.ref(buffer))
            return memoryview(buffer)

        async with await serve(on_link=send_one) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            link.set_body_sink(sink)
            link.deliver_to(lambda frame: got.append(bytes(frame.body)))
            for _ in range(250):  # bounded wait for the one frame
                if got:
                    break
                await asyncio.sleep(0.02)
            gc.collect()
            alive = [ref() is not None for ref in buffers]
            await link.close()
        return got, alive

    got, alive = run(main())
    assert len(got) == 1 and len(got[0]) == MIB
    assert alive == [False]  # the link is still open, and lets go of it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_bulk_reader_thread_runs_at_the_configured_niceness():
    import threading

    async def main():
        config = LinkConfig(bulk_reader_nice=7)
        async with await serve(config=config) as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            await link.send(Frame(FrameType.KV_CHUNK, {}, os.urandom(MIB)))  # bulk, echoed
            assert len((await link.recv()).body) == MIB
            readers = [t for t in threading.enumerate() if t.name.startswith(BULK_IN_THREAD)]
            nice = {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in readers}
            await link.close()
        return nice

    # The server side read the body at nice 7; the client's reader keeps the default.
    assert run(main()) == {0, 7}
