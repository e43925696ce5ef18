"""The HTTP front's drain gate: probes, and no new completions once draining (ASGI, no sockets)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from router_plugin.http.drain import DrainGate

pytestmark = pytest.mark.timeout(30)


class FakeFront:
    ready = True

    def health(self) -> JSONResponse:
        if self.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)


def app_behind_gate() -> tuple[DrainGate, FakeFront]:
    async def completions(_):
        return PlainTextResponse("tokens")

    async def health(_):
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/health", health), Route("/metrics", health)])
    front = FakeFront()
    return DrainGate(app, front), front


def test_readiness_follows_the_front_until_draining_and_liveness_stays_up():
    async def main() -> None:
        gate, front = app_behind_gate()
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health/ready")).status_code == 200
            front.ready = False  # no healthy node: not ready, but alive
            assert (await client.get("/health/ready")).status_code == 503
            assert (await client.get("/health/live")).status_code == 200
            front.ready = True
            assert (await client.post("/v1/completions")).text == "tokens"
            gate.draining = True
            for path in ("/health", "/health/ready"):
                response = await client.get(path)
                assert (response.status_code, response.json()) == (503, {"status": "draining"})
            assert (await client.get("/health/live")).json() == {"status": "ok"}
            refused = await client.post("/v1/completions")
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "node_draining"
            assert (await client.get("/metrics")).status_code == 200  # ops still answer

    asyncio.run(main())
