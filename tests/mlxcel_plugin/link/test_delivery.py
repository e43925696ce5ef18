"""Ordered handover of frames and bulk bodies to a handler, without sockets."""

import asyncio
import logging

from mlxcel_plugin.link.delivery import FrameDelivery
from mlxcel_plugin.link.protocol.frames import Frame, FrameType, MalformedFrame
from mlxcel_plugin.link.protocol.record_reader import BulkBody


def frame(name):
    return Frame(FrameType.KV_BEGIN, {"n": name})


def body(name):
    return BulkBody(FrameType.KV_CHUNK.value, {"n": name}, 4)


class Harness:
    """A delivery whose body reads are futures the test completes by hand."""

    def __init__(self, handler=None):
        self.handled, self.started, self.failures = [], {}, []
        self.delivery = FrameDelivery(handler or self.record, self.start_read,
                                      self.failures.append, "test")

    def record(self, f):
        self.handled.append(f.header["n"])

    def start_read(self, bulk):
        self.started[bulk.header["n"]] = future = asyncio.get_running_loop().create_future()
        return future

    def arrive(self, name):
        self.started[name].set_result(Frame(FrameType.KV_CHUNK, {"n": name}, b"body"))


async def settle():
    for _ in range(3):  # done-callbacks run on the next loop turns
        await asyncio.sleep(0)


def test_frames_wait_for_the_bodies_before_them_and_reads_wait_for_frames():
    async def main():
        h = Harness()
        for item in (frame("begin0"), body("chunk0"), body("chunk1"), frame("begin1"),
                     body("chunk2")):
            h.delivery.put(item)
        # begin0 is handled at once; both bodies behind it are read back to back; chunk2
        # waits for begin1, which waits for the bodies before it.
        assert h.handled == ["begin0"] and list(h.started) == ["chunk0", "chunk1"]
        h.arrive("chunk1")
        await settle()
        assert h.handled == ["begin0"]  # chunk1 is in, but chunk0 comes first
        h.arrive("chunk0")
        await settle()
        assert h.handled == ["begin0", "chunk0", "chunk1", "begin1"]
        assert list(h.started) == ["chunk0", "chunk1", "chunk2"]
        h.arrive("chunk2")
        await settle()
        assert h.handled[-1] == "chunk2" and not h.failures

    asyncio.run(main())


def test_a_body_that_failed_or_was_dropped_is_skipped():
    async def main():
        h = Harness()
        h.delivery.put(body("lost"))
        h.delivery.put(frame("after"))
        h.started["lost"].set_result(None)  # the read failed: the link is closing
        await settle()
        assert h.handled == ["after"]

    asyncio.run(main())


def test_a_protocol_error_in_the_handler_stops_delivery_and_reports_it():
    async def main():
        def refuse(f):
            raise MalformedFrame(f"no {f.header['n']}")

        h = Harness(handler=refuse)
        h.delivery.put(frame("a"))
        h.delivery.put(frame("b"))
        assert [str(e) for e in h.failures] == ["no a"]

    asyncio.run(main())


def test_a_failing_handler_is_logged_and_reported(caplog):
    async def main():
        def broken(f):
            raise KeyError("bug")

        h = Harness(handler=broken)
        with caplog.at_level(logging.ERROR, logger="mlxcel_plugin.link"):
            h.delivery.put(frame("a"))
        assert len(h.failures) == 1 and isinstance(h.failures[0], KeyError)

    asyncio.run(main())
    assert "link test: frame handler failed on a KV_BEGIN frame" in caplog.text
