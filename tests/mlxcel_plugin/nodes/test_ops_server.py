"""The node ops server on 127.0.0.1, port 0, hit over real sockets (httpx and raw bytes)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest

from mlxcel_plugin.nodes.metrics import DecodeMetrics
from mlxcel_plugin.nodes.ops_server import OpsLimits, OpsRoutes, OpsServer

HOST = "127.0.0.1"
WAIT_S = 10.0  # a bound on waits that should end at once, never a measurement
HEALTH = {"status": "ok", "role": "decode", "node_id": "d1", "active": 2}


def plain_routes() -> OpsRoutes:
    return OpsRoutes(lambda: HEALTH, lambda: (b"m 1\n", "text/plain"))


def decode_metrics() -> DecodeMetrics:
    return DecodeMetrics(lambda: 2, lambda: 3, lambda: 100, lambda: 50)


def serve(check: Callable[[OpsServer, str], Awaitable[None]], *,
          routes: OpsRoutes | None = None, limits: OpsLimits | None = None) -> None:
    """Start a server, run ``check(server, base_url)``, close it whatever happens."""
    routes = routes or OpsRoutes(lambda: HEALTH, decode_metrics().render)

    async def main() -> None:
        server = await OpsServer.start(HOST, 0, routes, limits or OpsLimits())
        try:
            await check(server, f"http://{HOST}:{server.address[1]}")
        finally:
            await server.close()

    asyncio.run(main())


async def raw_exchange(server: OpsServer, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends until it closes."""
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()


def test_health_is_json_and_ignores_the_query():
    async def check(_: OpsServer, url: str) -> None:
        async with httpx.AsyncClient() as client:
            response = await client.get(f"{url}/health?verbose=1")
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert response.json() == HEALTH

    serve(check)


def test_metrics_are_the_prometheus_text_exposition():
    async def check(_: OpsServer, url: str) -> None:
        async with httpx.AsyncClient() as client:
            response = await client.get(f"{url}/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=")
        assert "# TYPE mlxcel:decode_batch_size gauge" in response.text
        assert "mlxcel:decode_batch_size 3.0" in response.text

    serve(check)


def test_head_gets_the_headers_without_the_body():
    async def check(_: OpsServer, url: str) -> None:
        async with httpx.AsyncClient() as client:
            head = await client.head(f"{url}/health")
            get = await client.get(f"{url}/health")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(get.content))

    serve(check)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_unknown_paths_are_404_and_other_methods_405():
    async def check(_: OpsServer, url: str) -> None:
        async with httpx.AsyncClient() as client:
            for path in ("/nope", "/health/", "/", "/v1/models"):
                assert_openai_error(await client.get(f"{url}{path}"), 404, "not_found")
            for method in ("POST", "PUT", "DELETE"):
                response = await client.request(method, f"{url}/metrics", content=b"x")
                assert_openai_error(response, 405, "method_not_allowed")
                assert set(response.headers["allow"].split(", ")) == {"GET", "HEAD"}

    serve(check)


def test_a_failing_route_is_a_json_500():
    def broken() -> dict:
        raise RuntimeError("boom")

    async def check(_: OpsServer, url: str) -> None:
        async with httpx.AsyncClient() as client:
            assert_openai_error(await client.get(f"{url}/health"), 500, "internal_error")
            assert (await client.get(f"{url}/metrics")).status_code == 200

    serve(check, routes=OpsRoutes(broken, decode_metrics().render))


def test_malformed_and_oversized_heads_are_json_400s():
    limits = OpsLimits(max_head_bytes=1024)

    async def check(server: OpsServer, _: str) -> None:
        # A head still incomplete past the limit (h11 parses a whole one read at once).
        endless = b"GET /health HTTP/1.1\r\nHost: a\r\nX-Pad: " + b"a" * 4096
        for data in (b"garbage\r\n\r\n", endless):
            reply = await raw_exchange(server, data)
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 ")
            assert b"content-type: application/json" in head.lower()
            assert json.loads(body)["error"]["code"] == "bad_request"

    serve(check, limits=limits)


def test_a_head_that_never_completes_is_dropped():
    async def check(server: OpsServer, _: str) -> None:
        # Half a head, then silence: the server hangs up without answering.
        assert await raw_exchange(server, b"GET /health HTTP/1.1\r\nHost:") == b""
        # A whole head arriving in pieces is served.
        reader, writer = await asyncio.open_connection(*server.address)
        for piece in (b"GET /health HT", b"TP/1.1\r\nHost: a\r\n", b"\r\n"):
            writer.write(piece)
            await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), WAIT_S)).startswith(b"HTTP/1.1 200")
        writer.close()

    serve(check, limits=OpsLimits(head_timeout_s=0.2))


def test_connections_beyond_the_limit_get_503():
    async def check(server: OpsServer, url: str) -> None:
        _, idle = await asyncio.open_connection(*server.address)
        async with httpx.AsyncClient() as client:
            close = {"connection": "close"}  # httpx's own connection must not count as well
            assert (await client.get(f"{url}/health", headers=close)).status_code == 503
            idle.close()
            await idle.wait_closed()
            for _ in range(100):  # until the server has seen the idle one go
                response = await client.get(f"{url}/health", headers=close)
                if response.status_code == 200:
                    break
                await asyncio.sleep(0.05)
        assert response.status_code == 200

    serve(check, limits=OpsLimits(max_connections=2))


def test_the_node_keeps_its_signal_handlers():
    async def main() -> None:
        # As nodes/drain.StopSignals: the node's own loop handler, installed first.
        loop, stopped = asyncio.get_running_loop(), asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stopped.set)
        try:
            before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
            server = await OpsServer.start(HOST, 0, plain_routes())
            async with httpx.AsyncClient() as client:
                url = f"http://{HOST}:{server.address[1]}/health"
                assert (await client.get(url)).status_code == 200
            assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(stopped.wait(), WAIT_S)  # it reached the node, not uvicorn
            await server.close()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    asyncio.run(main())


def test_close_frees_the_port_and_leaves_no_task():
    async def main() -> tuple[int, set]:
        server = await OpsServer.start(HOST, 0, plain_routes())
        port = server.address[1]
        async with httpx.AsyncClient() as client:  # keep-alive: one connection stays open
            assert (await client.get(f"http://{HOST}:{port}/health")).status_code == 200
            await server.close()
            await server.close()  # idempotent
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://{HOST}:{port}/health")
        return port, asyncio.all_tasks() - {asyncio.current_task()}

    port, stray = asyncio.run(main())
    assert stray == set()
    with socket.socket() as sock:  # the same port binds again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))


def test_a_taken_port_fails_the_start():
    async def main() -> None:
        with socket.create_server((HOST, 0)) as taken:
            with pytest.raises(OSError):
                await OpsServer.start(HOST, taken.getsockname()[1], plain_routes())

    asyncio.run(main())


def test_readiness_fails_while_draining_and_liveness_does_not():
    draining = {"on": False}
    routes = OpsRoutes(lambda: HEALTH, decode_metrics().render, ready=lambda: not draining["on"])

    async def check(_: OpsServer, url: str) -> None:
        async with httpx.AsyncClient() as client:
            for path in ("/health", "/health/ready", "/health/live"):
                assert (await client.get(f"{url}{path}")).status_code == 200
            draining["on"] = True
            for path in ("/health", "/health/ready"):
                response = await client.get(f"{url}{path}")
                assert response.status_code == 503
                assert response.json() == {**HEALTH, "status": "draining"}
            live = await client.get(f"{url}/health/live")
            assert (live.status_code, live.json()) == (200, {"status": "ok"})

    serve(check, routes=routes)
