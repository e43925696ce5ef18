"""A lean streaming client for relay-throughput figures.

A Python client that parses every SSE line as JSON costs more per token than
the server it measures; on a 2-core machine it then sets the pace instead of
the server. This one speaks just enough HTTP/1.1 (one keep-alive connection
per stream, chunked responses) and counts content deltas with ``bytes.count``
on the whole body, so nearly all of its core is left to whatever else runs
there. Every response is checked for a complete stream (``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

CONTENT_DELTA = b'"delta":{"content":'
DONE = b"data: [DONE]\n\n"


@dataclass
class RelayRun:
    tokens: int
    responses: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


class RelayError(RuntimeError):
    """A response that was not a complete 200 event stream."""


async def _read_head(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise RelayError(f"status {status.decode()}: {head[:200]!r}")
    if b"transfer-encoding: chunked" not in head.lower():
        raise RelayError("expected a chunked event stream")


async def _read_chunked_body(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:  # until the zero-length chunk
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return b"".join(parts)
        parts.append(data[:-2])


async def _one_stream(reader, writer, request: bytes) -> int:
    writer.write(request)
    await _read_head(reader)
    body = await _read_chunked_body(reader)
    if not body.endswith(DONE):
        raise RelayError(f"stream ended without [DONE]: {body[-200:]!r}")
    return body.count(CONTENT_DELTA)


def _request_bytes(host: str, path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n\r\n")
    return head.encode() + payload


async def _worker(url: str, path: str, body: dict, next_index, deadline_s: float) -> list[int]:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    request = _request_bytes(parts.netloc, path, body)
    counts = []
    try:
        while next_index() is not None and time.perf_counter() < deadline_s:
            counts.append(await _one_stream(reader, writer, request))
    finally:
        writer.close()
    return counts


async def _run(url: str, path: str, body: dict, concurrency: int, requests: int,
               max_wall_s: float) -> RelayRun:
    remaining = iter(range(requests))
    start = time.perf_counter()
    deadline_s = start + max_wall_s
    results = await asyncio.gather(*[
        _worker(url, path, body, lambda: next(remaining, None), deadline_s)
        for _ in range(concurrency)])
    wall_s = time.perf_counter() - start
    counts = [n for worker in results for n in worker]
    return RelayRun(sum(counts), len(counts), wall_s)


def relay_run(url: str, body: dict, *, concurrency: int, requests: int,
              max_wall_s: float = 120.0, path: str = "/v1/chat/completions") -> RelayRun:
    """``requests`` streams over ``concurrency`` connections (bounded by ``max_wall_s``)."""
    return asyncio.run(_run(url, path, body, concurrency, requests, max_wall_s))
