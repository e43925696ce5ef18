"""``POST /v1/load_lora_adapter`` / ``unload`` on a router: every node of the pool, not one.

vLLM's users found that a load behind a load balancer reaches one replica; a
router knows all its nodes, so it sends the ADAPTER command to every connected
prefill and decode node and answers once all have (or ``timeout_s`` passed).
A node that loaded it is routable for it at once (the pool notes the reply;
its telemetry confirms within one interval). A load that fails on any node is
a 400 naming the nodes and their errors (the others keep it: load again, or
unload); an unload that no node held is a 404.

The cluster's adapter set is one thing: the router remembers each run-time load
and unload (the last per name) and replays them, in order, on every prefill or
decode node that connects later (a node added through discovery, or restarted).
Until a joining node has loaded an adapter it does not announce it, so the
router routes that adapter's requests around it (``adapter_routing.py``) and no
request meets a node without its adapter; once the node replies it is routable.
vLLM and SGLang users met adapters missing on new replicas, loaded only on the
replicas that were up when ``load_lora_adapter`` ran.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from mlxcel_plugin.errors import InvalidRequestError, ModelNotFoundError, NoHealthyNodeError
from mlxcel_plugin.link.protocol.frames import AdapterCommand
from router_plugin.cluster.peer_links import PeerEvent, PeerLink, PeerLinks
from router_plugin.cluster.stream_bridge import DECODE, PREFILL

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 120.0
_ABSENT = object()  # no run-time command for that name yet


async def _on_node(peer: PeerLink, command: AdapterCommand, timeout_s: float) -> AdapterCommand:
    """The node's reply; a lost link or silence is a ``failed`` reply."""
    reply: asyncio.Future[AdapterCommand] = asyncio.get_running_loop().create_future()

    def sink(event: PeerEvent) -> None:
        if not reply.done():
            reply.set_result(event.adapter or command.reply(error=event.error or "link lost",
                                                            code="node_lost"))  # fmt: skip

    peer.register(command.command_id, sink)
    try:
        await peer.send(command.to_frame())
        return await asyncio.wait_for(reply, timeout_s)
    except (TimeoutError, Exception) as exc:  # noqa: BLE001 - one node's failure is reported
        return command.reply(error=str(exc) or type(exc).__name__, code="node_failed")
    finally:
        peer.unregister(command.command_id)


class ClusterAdapters:
    """What the router's adapter routes call: a command on every node, then the pool notes it."""

    def __init__(self, peers: PeerLinks, clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = COMMAND_TIMEOUT_S):
        self.peers, self.clock, self.timeout_s = peers, clock, timeout_s
        self.runtime: dict[str, str | None] = {}  # name -> path loaded at run time; None: unloaded
        self._catch_ups: set[asyncio.Task[None]] = set()
        peers.set_on_connect(self.on_connect)

    def on_connect(self, peer: PeerLink) -> None:
        """A node (re)connected: replay the run-time loads and unloads on it, off the reader."""
        if peer.role not in (PREFILL, DECODE) or not self.runtime:
            return
        task = asyncio.get_running_loop().create_task(self._catch_up(peer, dict(self.runtime)))
        self._catch_ups.add(task)
        task.add_done_callback(self._catch_ups.discard)

    async def _catch_up(self, peer: PeerLink, runtime: dict[str, str | None]) -> None:
        for name, path in runtime.items():
            op = "unload" if path is None else "load"
            reply = await self._on_node(peer, self._command(op, name, path or ""))
            if reply.op == "done":
                logger.info("%s caught up: adapter %s %sed", peer.node_id, name, op)
            elif op == "load":  # it stays out of this adapter's routes; the others serve it
                logger.warning("%s did not load the adapter %s: %s", peer.node_id, name,
                               reply.error)  # fmt: skip

    def _command(self, op: str, name: str, path: str = "") -> AdapterCommand:
        return AdapterCommand(f"adapter-{uuid.uuid4().hex}", op, name, lora_path=path)

    async def _on_node(self, peer: PeerLink, command: AdapterCommand) -> AdapterCommand:
        """The node's reply; a node that did it is routable for it at once."""
        reply = await _on_node(peer, command, self.timeout_s)
        if reply.op == "done":
            loaded = command.op == "load"
            self.peers.pool.note_adapter(peer.node_id, command.lora_name,
                                         reply.digest if loaded else None)  # fmt: skip
        return reply

    async def _everywhere(self, op: str, name: str, path: str = "") -> dict[str, AdapterCommand]:
        nodes = [peer for role in (PREFILL, DECODE) for peer in self.peers.of_role(role)
                 if peer.connected]  # fmt: skip
        if not nodes:
            raise NoHealthyNodeError("no prefill or decode node is connected")
        command = self._command(op, name, path)
        replies = await asyncio.gather(*(self._on_node(peer, command) for peer in nodes))
        return {peer.node_id: reply for peer, reply in zip(nodes, replies, strict=True)}

    async def _remembered(self, op: str, name: str,
                          path: str | None) -> dict[str, AdapterCommand]:  # fmt: skip
        """The command on every node, kept for nodes joining later unless no node took it."""
        before = self.runtime.get(name, _ABSENT)
        self.runtime[name] = path  # a node connecting meanwhile catches up on it too
        replies: dict[str, AdapterCommand] = {}
        try:
            replies = await self._everywhere(op, name, path or "")
        finally:
            if not any(reply.op == "done" for reply in replies.values()):
                self.runtime.pop(name, None)
                if before is not _ABSENT:
                    self.runtime[name] = before
        return replies

    async def load(self, name: str, path: str) -> dict[str, Any]:
        replies = await self._remembered("load", name, path)
        failed = {node: r.error for node, r in replies.items() if r.op == "failed"}
        if failed:
            detail = "; ".join(f"{node}: {error}" for node, error in sorted(failed.items()))
            raise InvalidRequestError(f"the adapter did not load on {len(failed)} of "
                                      f"{len(replies)} nodes ({detail})", param="lora_path")
        digests = {node: r.digest for node, r in replies.items()}
        return {"digest": sorted(set(digests.values()))[0], "nodes": digests}

    async def unload(self, name: str) -> dict[str, Any]:
        replies = await self._remembered("unload", name, None)
        unloaded = sorted(node for node, r in replies.items() if r.op == "done")
        if not unloaded:
            raise ModelNotFoundError(f"the adapter {name!r} is not loaded", param="lora_name")
        return {"nodes": unloaded}
