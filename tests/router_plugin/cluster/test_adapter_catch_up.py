"""The router's run-time adapter set reaches nodes that connect later (``adapter_commands.py``).

Fake nodes answer ADAPTER commands from a dict of what they hold; no sockets. The end-to-end
version (a decode node added through the peers file) is in
``tests/integration/test_adapters_cluster.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from mlxcel_plugin.errors import NoHealthyNodeError
from mlxcel_plugin.link.protocol.frames import AdapterCommand
from router_plugin.cluster.adapter_commands import ClusterAdapters
from router_plugin.cluster.peer_links import PeerEvent
from router_plugin.cluster.stream_bridge import DECODE, PREFILL


class FakeNode:
    """A connected node that loads any path except ``bad`` and holds name -> digest."""

    def __init__(self, node_id: str, role: str, held: dict[str, str] | None = None):
        self.node_id, self.role, self.connected = node_id, role, True
        self.held = dict(held or {})
        self.commands: list[tuple[str, str]] = []
        self._sinks: dict[str, object] = {}

    def register(self, command_id: str, sink) -> None:
        self._sinks[command_id] = sink

    def unregister(self, command_id: str) -> None:
        self._sinks.pop(command_id, None)

    async def send(self, frame) -> None:
        command = AdapterCommand.from_frame(frame)
        self.commands.append((command.op, command.lora_name))
        if command.op == "load" and command.lora_path != "bad":
            self.held[command.lora_name] = f"digest-of-{command.lora_path}"
            reply = command.reply(digest=self.held[command.lora_name])
        elif command.op == "unload" and self.held.pop(command.lora_name, None):
            reply = command.reply()
        else:
            reply = command.reply(error="cannot", code="model_not_found")
        self._sinks[command.command_id](PeerEvent(self.role, self.node_id, adapter=reply))


class FakePool:
    def __init__(self) -> None:
        self.noted: list[tuple[str, str, str | None]] = []

    def note_adapter(self, node_id: str, name: str, digest: str | None) -> None:
        self.noted.append((node_id, name, digest))


class FakePeers:
    def __init__(self, nodes: list[FakeNode]):
        self.nodes, self.pool, self.on_connect = nodes, FakePool(), None

    def set_on_connect(self, on_connect) -> None:
        self.on_connect = on_connect

    def of_role(self, role: str):
        return [node for node in self.nodes if node.role == role]

    async def join(self, node: FakeNode) -> None:
        """A node added by discovery connects; wait for the catch-up it triggers."""
        self.nodes.append(node)
        self.on_connect(node)
        await asyncio.gather(*self.adapters._catch_ups)


def cluster(*nodes: FakeNode) -> tuple[FakePeers, ClusterAdapters]:
    peers = FakePeers(list(nodes))
    peers.adapters = ClusterAdapters(peers)
    return peers, peers.adapters


def test_a_node_joining_later_gets_the_run_time_loads_and_unloads() -> None:
    async def scenario() -> None:
        peers, adapters = cluster(FakeNode("p1", PREFILL), FakeNode("d1", DECODE, {"old": "x"}))
        await adapters.load("a", "/a")
        await adapters.load("b", "/b")
        await adapters.unload("b")
        await adapters.unload("old")  # a start-up adapter unloaded at run time
        late = FakeNode("d2", DECODE, {"old": "x"})  # started with the same flags as d1
        await peers.join(late)
        assert late.held == {"a": "digest-of-/a"}
        assert ("d2", "a", "digest-of-/a") in peers.pool.noted  # routable for it at once

    asyncio.run(scenario())


def test_only_commands_some_node_took_are_replayed() -> None:
    async def scenario() -> None:
        peers, adapters = cluster(FakeNode("p1", PREFILL), FakeNode("d1", DECODE))
        await adapters.load("a", "/a")
        with pytest.raises(Exception, match="did not load"):
            await adapters.load("a", "bad")  # no node took it: "a" stays at /a
        with pytest.raises(Exception, match="not loaded"):
            await adapters.unload("never")
        assert adapters.runtime == {"a": "/a"}
        late = FakeNode("d2", DECODE)
        await peers.join(late)
        assert late.commands == [("load", "a")]

    asyncio.run(scenario())


def test_no_node_connected_forgets_the_command() -> None:
    async def scenario() -> None:
        _, adapters = cluster()
        with pytest.raises(NoHealthyNodeError):
            await adapters.load("a", "/a")
        assert adapters.runtime == {}

    asyncio.run(scenario())


def test_a_router_with_no_run_time_commands_sends_nothing_on_connect() -> None:
    async def scenario() -> None:
        peers, _ = cluster(FakeNode("p1", PREFILL))
        late = FakeNode("d1", DECODE, {"s": "x"})
        await peers.join(late)
        assert late.commands == [] and late.held == {"s": "x"}

    asyncio.run(scenario())
