"""A link-speaking stand-in for the router: claim on decode, request on prefill, merge results.

Used by the node integration tests and the decode-isolation benchmark (the
router's own stream bridge does the same merge with more care)::

    async with LinkDriver(secret, prefill_addr, decode_addr) as driver:
        outcome = await driver.generate("r1", [1, 2, 3], max_tokens=8)
        outcome.tokens, outcome.finish_reason

``generate`` sends REQUEST ``claim=True`` to decode, then REQUEST with
``decode_target`` to prefill, and collects RESULT seq 0 (prefill) and seq
1, 2, ... (decode) until the terminal one, or an ERROR frame for the request.
``decode_cached_tokens`` says, as the router would, that the decode node holds
that many prompt tokens already (a delta handoff).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxcel_plugin.link import ClusterSecret, Link, dial_link
from mlxcel_plugin.link.protocol.frames import (
    Cancel,
    ErrorFrame,
    Frame,
    FrameType,
    Request,
    Result,
    Telemetry,
)


@dataclass
class Outcome:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    token_times_s: list[float] = field(default_factory=list)  # arrival, per token

    @property
    def ok(self) -> bool:
        return self.finish_reason in ("stop", "length")


class _Collector:
    """Orders results by seq (a frame's first token); done at the terminal one with no gap."""

    def __init__(self, request_id: str):
        self.outcome = Outcome(request_id)
        self.results: dict[int, Result] = {}
        self.done = asyncio.Event()
        self._next = 0

    def add(self, result: Result) -> None:
        self.results.setdefault(result.seq, result)
        if result.finish_reason == "error":
            self._end(result.finish_reason, result.error, "error")
            return
        while self._next in self.results:  # consumes the contiguous prefix
            current = self.results[self._next]
            self.outcome.tokens.extend(current.token_ids)
            self.outcome.token_times_s.extend([time.perf_counter()] * len(current.token_ids))
            if current.finish_reason is not None:
                self._end(current.finish_reason, current.error, None)
                return
            if not current.token_ids:
                return  # nothing to advance past; wait for the next frame
            self._next += len(current.token_ids)  # a frame may carry several tokens

    def fail(self, error: ErrorFrame) -> None:
        self._end("error", error.message, error.code)

    def _end(self, reason: str, error: str | None, code: str | None) -> None:
        if not self.done.is_set():
            self.outcome.finish_reason, self.outcome.error = reason, error
            self.outcome.error_code = code
            self.done.set()


class LinkDriver:
    def __init__(self, secret: ClusterSecret | bytes, prefill: str, decode: str,
                 node_id: str = "test-router"):
        self.secret, self.prefill_addr, self.decode_addr = secret, prefill, decode
        self.node_id = node_id
        self.prefill: Link | None = None
        self.decode: Link | None = None
        self.telemetry: dict[str, list[Telemetry]] = {}
        self.errors: list[ErrorFrame] = []  # ERROR frames with no request id
        self._collectors: dict[str, _Collector] = {}
        self._readers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> LinkDriver:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        self.prefill = await dial_link(self.prefill_addr, self.secret, "router", self.node_id,
                                       expect_roles={"prefill"})
        self.decode = await dial_link(self.decode_addr, self.secret, "router", self.node_id,
                                      expect_roles={"decode"})
        self._readers = [asyncio.create_task(self._read(link))
                         for link in (self.prefill, self.decode)]

    async def close(self) -> None:
        for link in (self.prefill, self.decode):
            if link is not None:
                await link.close()
        for task in self._readers:
            task.cancel()

    async def _read(self, link: Link) -> None:
        async for frame in link:  # until the link closes
            self._dispatch(frame)

    def _dispatch(self, frame: Frame) -> None:
        if frame.type is FrameType.RESULT:
            result = Result.from_frame(frame)
            collector = self._collectors.get(result.request_id)
            if collector is not None:
                collector.add(result)
        elif frame.type is FrameType.ERROR:
            error = ErrorFrame.from_frame(frame)
            collector = self._collectors.get(error.request_id or "")
            if collector is None:
                self.errors.append(error)
            else:
                collector.fail(error)
        elif frame.type is FrameType.TELEMETRY:
            telemetry = Telemetry.from_frame(frame)
            self.telemetry.setdefault(telemetry.role, []).append(telemetry)

    # -- requests ------------------------------------------------------------------

    def expect(self, request_id: str) -> _Collector:
        return self._collectors.setdefault(request_id, _Collector(request_id))

    async def claim(self, request_id: str, max_tokens: int,
                    sampling: dict[str, Any] | None = None,
                    stop_token_ids: Sequence[int] = ()) -> None:
        claim = Request(request_id, [], dict(sampling or {}), max_tokens, list(stop_token_ids),
                        claim=True)
        await self.decode.send(claim.to_frame())

    async def submit(self, request_id: str, prompt: Sequence[int], max_tokens: int,
                     sampling: dict[str, Any] | None = None,
                     stop_token_ids: Sequence[int] = (), decode_target: str | None = None,
                     claim: bool = True, decode_cached_tokens: int = 0) -> _Collector:
        """Claim (optionally) and send; returns the collector to await."""
        collector = self.expect(request_id)
        if claim:
            await self.claim(request_id, max_tokens, sampling, stop_token_ids)
        request = Request(request_id, list(prompt), dict(sampling or {}), max_tokens,
                          list(stop_token_ids), decode_target or self.decode_addr,
                          decode_cached_tokens=decode_cached_tokens)
        await self.prefill.send(request.to_frame())
        return collector

    async def wait(self, collector: _Collector, timeout_s: float = 60.0) -> Outcome:
        await asyncio.wait_for(collector.done.wait(), timeout_s)
        self._collectors.pop(collector.outcome.request_id, None)
        outcome = collector.outcome
        first = collector.results.get(0)
        ended_at_prefill = first is not None and first.finish_reason is not None
        if (ended_at_prefill or outcome.finish_reason == "error") and not self.decode.closed:
            # Like the router: a claim nobody will feed is released, not left to time out.
            await self.decode.send(Cancel(outcome.request_id, "ended elsewhere").to_frame())
        return outcome

    async def generate(self, request_id: str, prompt: Sequence[int], max_tokens: int,
                       sampling: dict[str, Any] | None = None,
                       stop_token_ids: Sequence[int] = (), decode_target: str | None = None,
                       timeout_s: float = 60.0, decode_cached_tokens: int = 0) -> Outcome:
        collector = await self.submit(request_id, prompt, max_tokens, sampling, stop_token_ids,
                                      decode_target, decode_cached_tokens=decode_cached_tokens)
        return await self.wait(collector, timeout_s)

    async def generate_local(self, request_id: str, prompt: Sequence[int], max_tokens: int,
                             sampling: dict[str, Any] | None = None,
                             timeout_s: float = 60.0) -> Outcome:
        """A REQUEST without claim to the decode node: it prefills (from its cache) and decodes."""
        collector = self.expect(request_id)
        request = Request(request_id, list(prompt), dict(sampling or {}), max_tokens)
        await self.decode.send(request.to_frame())
        await asyncio.wait_for(collector.done.wait(), timeout_s)
        self._collectors.pop(request_id, None)
        return collector.outcome

    async def cancel(self, request_id: str) -> None:
        frame = Cancel(request_id, "client went away").to_frame()
        await self.prefill.send(frame)
        await self.decode.send(frame)
