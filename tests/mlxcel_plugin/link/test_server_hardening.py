"""The server's unauthenticated surface: one deadline from accept, junk logged cheaply."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from mlxcel_plugin.link import LinkConfig, dial_link, serve_links
from mlxcel_plugin.link.protocol.handshake import ClientHandshake
from mlxcel_plugin.link.refusal_log import RefusalLog
from mlxcel_plugin.testing.link_attacker import announce_bulk_body, send_junk

SECRET = bytes(range(32))
pytestmark = pytest.mark.timeout(30)


async def echo(link):
    async for frame in link:
        await link.send(frame)


async def serve(**kw):
    return await serve_links("127.0.0.1:0", SECRET, "decode", "d1", {"prefill", "router"},
                             echo, **kw)


def test_the_handshake_deadline_counts_from_accept_not_from_the_upgrade():
    deadline_s = 2.0

    async def main():
        async with await serve(config=LinkConfig(handshake_timeout_s=deadline_s)) as server:
            loop = asyncio.get_running_loop()
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", server.port))
            await asyncio.sleep(0.6 * deadline_s)  # a slow upgrade, still inside the deadline
            ws = await connect(f"ws://{server.address}/link", sock=sock, compression=None,
                               proxy=None)
            # Past the deadline from accept, well before a deadline restarted at the upgrade:
            await asyncio.sleep(0.7 * deadline_s)
            hs = ClientHandshake(SECRET, "prefill", "slowpoke")
            with pytest.raises(ConnectionClosed) as info:
                await ws.send(hs.start())
                await ws.recv()
            return info.value

    closed = asyncio.run(main())
    assert closed.rcvd is not None
    assert (closed.rcvd.code, closed.rcvd.reason) == (1008, "handshake_timeout")


def test_refusals_log_one_warning_per_interval_and_count_the_rest(caplog):
    now = [100.0]
    log = RefusalLog("d1", interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="mlxcel_plugin.link"):
        for _ in range(50):
            log.refused("10.0.0.9:5", "not a bulk channel hello", exc_info=ValueError("x"))
        now[0] += 11.0
        log.refused("10.0.0.9:6", "handshake failed")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "49 more refused" in warnings[1].getMessage()
    assert all(r.exc_info is None for r in warnings)  # tracebacks only at DEBUG
    assert log.total == 51


def test_junk_on_link_and_bulk_ports_logs_no_traceback(caplog):
    async def main():
        async with await serve() as server:
            await send_junk(server.address, b"\x00\xffjunk\r\n\r\n", 20)
            await send_junk(f"127.0.0.1:{server.bulk_port}", b"MLXB" + b"\x00" * 48, 20)
            await asyncio.sleep(0.2)
            link = await dial_link(server.address, SECRET, "prefill", "p1")  # still serving
            await link.close()

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
    refusals = [r for r in caplog.records if "before authentication" in r.getMessage()]
    assert 1 <= len(refusals) <= 2


def test_a_bulk_body_that_never_comes_takes_no_memory_and_closes_cleanly():
    async def main():
        async with await serve() as server:
            link = await dial_link(server.address, SECRET, "prefill", "p1")
            await announce_bulk_body(link, 900 * 1024 * 1024)
            await asyncio.sleep(0.2)
            (served,) = server.links
            await link.close()
            await served.wait_closed()
            return served

    served = asyncio.run(main())
    assert served.closed
