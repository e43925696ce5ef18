"""In-process prefill and decode nodes that speak the real link protocol to a router.

They follow docs/cluster-flow.md on the router's links (CLAIM on decode,
REQUEST with ``decode_target`` on prefill, RESULT seq 0 from prefill, 1, 2, ...
from decode, CANCEL, TELEMETRY, ERROR); the KV handoff itself is a direct
method call between the two fakes (it is not the router's business). Tokens
come from a script: ``script(prompt_token_ids) -> completion token ids``.

As a process (zero-cost nodes for router benchmarks)::

    python -m mlxcel_plugin.testing.fake_peers --cluster-secret-file F \
        --prefill-bind 127.0.0.1:P --decode-bind 127.0.0.1:D
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlxcel_plugin.link import ClusterSecret, Link, LinkServer, load_cluster_secret, serve_links
from mlxcel_plugin.link.protocol.frames import (
    Cancel,
    ErrorFrame,
    FrameType,
    Request,
    Result,
    Telemetry,
)

SECRET = bytes(range(32))
EOS = 2
Script = Callable[[Sequence[int]], list[int]]


def echo_script(prompt: Sequence[int]) -> list[int]:
    """Five tokens derived from the prompt, then EOS."""
    base = sum(prompt) % 500 + 10
    return [base + i for i in range(5)] + [EOS]


@dataclass
class _Claim:
    link: Link
    request: Request


@dataclass
class FakeNode:
    """Common part: a link listener, its router links, telemetry, and what it received."""

    role: str
    node_id: str
    bind: str = "127.0.0.1:0"
    secret: ClusterSecret | bytes = SECRET
    telemetry_interval_s: float = 0.2
    prefix_cached_bytes: int = 0  # what its telemetry reports of a prefix cache
    prefix_capacity_bytes: int = 0
    server: LinkServer | None = None
    received: list[object] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    links: set[Link] = field(default_factory=set)

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> FakeNode:
        self.server = await serve_links(self.bind, self.secret, self.role, self.node_id,
                                        {"router"}, self._on_link)
        self.bind = self.server.address  # a restart comes back on the same port
        return self

    async def stop(self) -> None:
        """Like a killed process: every link drops, the port stops answering."""
        if self.server is not None:
            await self.server.close()
            self.server = None

    async def _on_link(self, link: Link) -> None:
        self.links.add(link)
        ticker = asyncio.create_task(self._telemetry(link))
        try:
            async for frame in link:
                self.received.append(frame)
                await self.on_frame(link, frame)
        finally:
            ticker.cancel()
            self.links.discard(link)
            self.on_link_closed(link)

    async def _telemetry(self, link: Link) -> None:
        while not link.closed:  # ends with the link
            report = Telemetry(self.node_id, self.role, active_sequences=self.active(),
                               prefix_cached_bytes=self.prefix_cached_bytes,
                               prefix_capacity_bytes=self.prefix_capacity_bytes)
            await link.send(report.to_frame())
            await asyncio.sleep(self.telemetry_interval_s)

    def active(self) -> int:
        return 0

    async def on_frame(self, link: Link, frame) -> None:
        raise NotImplementedError

    def on_link_closed(self, link: Link) -> None:
        return None


@dataclass
class FakeDecode(FakeNode):
    role: str = "decode"
    node_id: str = "fake-decode"
    token_delay_s: float = 0.0
    claims: dict[str, _Claim] = field(default_factory=dict)
    claimed: list[str] = field(default_factory=list)
    streams: dict[str, asyncio.Task] = field(default_factory=dict)
    local: list[str] = field(default_factory=list)  # requests it prefilled itself

    def active(self) -> int:
        return len(self.claims)

    def _start_local(self, claim: _Claim) -> None:
        self.streams[claim.request.request_id] = asyncio.create_task(self._local(claim))

    async def _local(self, claim: _Claim) -> None:
        request = claim.request
        tokens = echo_script(request.prompt_token_ids)
        ends = request.max_tokens == 1
        await claim.link.send(Result(request.request_id, 0, tokens[:1],
                                     "length" if ends else None, 1).to_frame())
        if not ends:
            await self._stream(claim, tokens[1:])

    async def on_frame(self, link: Link, frame) -> None:
        if frame.type is FrameType.REQUEST:
            request = Request.from_frame(frame)
            self.claims[request.request_id] = _Claim(link, request)
            if not request.claim:  # a local request: prefill here too, stream from seq 0
                self.local.append(request.request_id)
                self._start_local(self.claims[request.request_id])
                return
            self.claimed.append(request.request_id)
        elif frame.type is FrameType.CANCEL:
            request_id = Cancel.from_frame(frame).request_id
            self.cancelled.append(request_id)
            self.claims.pop(request_id, None)
            task = self.streams.pop(request_id, None)
            if task is not None:
                task.cancel()

    def on_link_closed(self, link: Link) -> None:
        for request_id, claim in list(self.claims.items()):
            if claim.link is link:
                self.claims.pop(request_id)
                task = self.streams.pop(request_id, None)
                if task is not None:
                    task.cancel()

    def handoff(self, request_id: str, tokens: list[int]) -> bool:
        """The KV arrived (from an in-process FakePrefill): stream ``tokens`` from seq 1."""
        claim = self.claims.get(request_id)
        if claim is None:
            return False
        self.streams[request_id] = asyncio.create_task(self._stream(claim, tokens))
        return True

    async def _stream(self, claim: _Claim, tokens: list[int]) -> None:
        request = claim.request
        limit = min(len(tokens), request.max_tokens - 1)
        if not self.token_delay_s and EOS not in tokens[:limit]:
            await self._send_at_once(claim, tokens[:limit], limit == len(tokens))
            return
        for i in range(limit):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == limit - 1
            finish = None
            if tokens[i] == EOS or (last and limit == len(tokens)):
                finish, last = "stop", True
            elif last:
                finish = "length"
            await claim.link.send(Result(request.request_id, i + 1, [tokens[i]], finish,
                                         i + 2).to_frame())
            if last:
                break
        self.claims.pop(request.request_id, None)
        self.streams.pop(request.request_id, None)


    async def _send_at_once(self, claim: _Claim, tokens: list[int], ran_out: bool) -> None:
        """Zero cost: every token is ready at once, so one RESULT carries them all."""
        request = claim.request
        finish = "stop" if ran_out else "length"
        await claim.link.send(Result(request.request_id, 1, tokens, finish,
                                     len(tokens) + 1).to_frame())
        self.claims.pop(request.request_id, None)
        self.streams.pop(request.request_id, None)


@dataclass
class FakePrefill(FakeNode):
    role: str = "prefill"
    node_id: str = "fake-prefill"
    script: Script = echo_script
    decodes: dict[str, FakeDecode] = field(default_factory=dict)  # address -> node
    prefill_delay_s: float = 0.0
    # Fault knobs, each for the next request only when set.
    drop_link_on_request: bool = False
    error_code: str | None = None
    requests: list[Request] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)

    async def on_frame(self, link: Link, frame) -> None:
        if frame.type is FrameType.CANCEL:
            self.cancelled.append(Cancel.from_frame(frame).request_id)
            return
        if frame.type is not FrameType.REQUEST:
            return
        request = Request.from_frame(frame)
        self.requests.append(request)
        if self.drop_link_on_request:
            self.drop_link_on_request = False
            await link.close(flush=False)
            return
        if self.error_code is not None:
            code, self.error_code = self.error_code, None
            await link.send(ErrorFrame(code, f"{self.node_id} says {code}",
                                       request.request_id).to_frame())
            return
        if self.prefill_delay_s:
            self._spawn(self._prefill(link, request))
        else:
            await self._prefill(link, request)  # zero cost: the first token goes out now

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _prefill(self, link: Link, request: Request) -> None:
        if self.prefill_delay_s:
            await asyncio.sleep(self.prefill_delay_s)
        tokens = self.script(request.prompt_token_ids)
        ends = tokens[0] == EOS or len(tokens) == 1 or request.max_tokens == 1
        finish = None
        if ends:
            finish = "stop" if tokens[0] == EOS or len(tokens) == 1 else "length"
        await link.send(Result(request.request_id, 0, [tokens[0]], finish, 1).to_frame())
        if finish is None:
            self._spawn(self._handoff(self.decodes[request.decode_target], request, tokens[1:]))

    async def _handoff(self, decode: FakeDecode, request: Request, tokens: list[int]) -> None:
        # The claim went first but on another link: give it a moment to land, like a real node.
        for _ in range(200):
            if decode.handoff(request.request_id, tokens):
                return
            await asyncio.sleep(0.005)


# ---------------------------------------------------------------- as a process


@functools.lru_cache(maxsize=64)
def _long_completion(base: int, length: int) -> tuple[int, ...]:
    return tuple(100 + (base + i * 7919) % 20000 for i in range(length))


def long_script(prompt: Sequence[int], length: int = 8192) -> list[int]:
    """``length`` regular tokens that depend on the prompt, no EOS: max_tokens ends it."""
    return list(_long_completion(sum(prompt) % 1000, length))


async def serve_pair(secret: ClusterSecret, prefill_bind: str, decode_bind: str) -> None:
    decode = await FakeDecode(bind=decode_bind, secret=secret).start()
    prefill = FakePrefill(bind=prefill_bind, secret=secret, script=long_script,
                          decodes={decode.address: decode})
    await prefill.start()
    await asyncio.Event().wait()  # until the process is stopped


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    from mlxcel_plugin.nodes.roles import run_event_loop

    parser = argparse.ArgumentParser(description="zero-cost prefill + decode link peers")
    parser.add_argument("--cluster-secret-file", required=True)
    parser.add_argument("--prefill-bind", required=True)
    parser.add_argument("--decode-bind", required=True)
    args = parser.parse_args(argv)
    secret = load_cluster_secret(args.cluster_secret_file, os.environ)
    run_event_loop(serve_pair(secret, args.prefill_bind, args.decode_bind))  # as real nodes do
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
