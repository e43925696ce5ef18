"""``POST /v1/load_lora_adapter`` / ``unload`` on a router: every node of the pool, not one.

vLLM's users found that a load behind a load balancer reaches one replica; a
router knows all its nodes, so it sends the ADAPTER command to every connected
prefill and decode node and answers once all have (or ``timeout_s`` passed).
A node that loaded it is routable for it at once (the pool notes the reply;
its telemetry confirms within one interval). A load that fails on any node is
a 400 naming the nodes and their errors (the others keep it: load again, or
unload); an unload that no node held is a 404.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from mlxcel_plugin.errors import InvalidRequestError, ModelNotFoundError, NoHealthyNodeError
from mlxcel_plugin.link.protocol.frames import AdapterCommand
from router_plugin.cluster.peer_links import PeerEvent, PeerLink, PeerLinks
from router_plugin.cluster.stream_bridge import DECODE, PREFILL

COMMAND_TIMEOUT_S = 120.0


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

    async def _everywhere(self, op: str, name: str, path: str = "") -> dict[str, AdapterCommand]:
        nodes = [peer for role in (PREFILL, DECODE) for peer in self.peers.of_role(role)
                 if peer.connected]  # fmt: skip
        if not nodes:
            raise NoHealthyNodeError("no prefill or decode node is connected")
        command = AdapterCommand(f"adapter-{uuid.uuid4().hex}", op, name, lora_path=path)
        replies = await asyncio.gather(*(_on_node(p, command, self.timeout_s) for p in nodes))
        for peer, reply in zip(nodes, replies, strict=True):
            if reply.op == "done":
                self.peers.pool.note_adapter(peer.node_id, name, reply.digest if op == "load"
                                             else None)  # fmt: skip
        return {peer.node_id: reply for peer, reply in zip(nodes, replies, strict=True)}

    async def load(self, name: str, path: str) -> dict[str, Any]:
        replies = await self._everywhere("load", name, path)
        failed = {node: r.error for node, r in replies.items() if r.op == "failed"}
        if failed:
            detail = "; ".join(f"{node}: {error}" for node, error in sorted(failed.items()))
            raise InvalidRequestError(f"the adapter did not load on {len(failed)} of "
                                      f"{len(replies)} nodes ({detail})", param="lora_path")
        digests = {node: r.digest for node, r in replies.items()}
        return {"digest": sorted(set(digests.values()))[0], "nodes": digests}

    async def unload(self, name: str) -> dict[str, Any]:
        replies = await self._everywhere("unload", name)
        unloaded = sorted(node for node, r in replies.items() if r.op == "done")
        if not unloaded:
            raise ModelNotFoundError(f"the adapter {name!r} is not loaded", param="lora_name")
        return {"nodes": unloaded}
