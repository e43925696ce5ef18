"""A node's adapters: announced from the engine, checked per request, loaded on command."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel_plugin.errors import ModelNotFoundError
from mlxcel_plugin.link.protocol.frames import AdapterCommand, Frame
from mlxcel_plugin.nodes.node_adapters import AdapterNotLoaded, NodeAdapters


class LoraEngine:
    """What a LoRA engine offers a node (engines/lora/engine.py), without MLX."""

    def __init__(self) -> None:
        self.held = {"sql": "d1"}

    def adapter_digests(self) -> dict[str, str]:
        return dict(self.held)

    def load_adapter(self, name: str, path: str) -> str:
        self.held[name] = f"digest-of-{path}"
        return self.held[name]

    def unload_adapter(self, name: str) -> None:
        if self.held.pop(name, None) is None:
            raise ModelNotFoundError(f"the adapter {name!r} is not loaded", param="lora_name")


def test_requests_are_checked_against_what_the_engine_holds():
    adapters = NodeAdapters(LoraEngine())
    assert adapters.held() == {"sql": "d1"}
    adapters.check(None, None)  # the base
    adapters.check("sql", "d1")
    adapters.check("sql", None)  # a local request names no digest
    with pytest.raises(AdapterNotLoaded, match="not d2") as other:
        adapters.check("sql", "d2")
    assert other.value.code == "adapter_not_loaded"
    with pytest.raises(AdapterNotLoaded):
        adapters.check("chat", "d1")


def test_an_engine_without_adapters_announces_none_and_refuses_commands():
    adapters = NodeAdapters(object())
    assert adapters.held() == {}
    reply = run_command(adapters, AdapterCommand("c1", "load", "sql", lora_path="/x"))
    assert reply.op == "failed" and "--enable-lora" in reply.error


def run_command(adapters: NodeAdapters, command: AdapterCommand) -> AdapterCommand:
    async def main() -> AdapterCommand:
        replies: asyncio.Queue[Frame] = asyncio.Queue()
        adapters.on_command(command, replies.put_nowait)
        return AdapterCommand.from_frame(await asyncio.wait_for(replies.get(), 10))

    return asyncio.run(main())


def test_load_and_unload_commands_answer_with_the_command_id():
    engine = LoraEngine()
    adapters = NodeAdapters(engine)
    loaded = run_command(adapters, AdapterCommand("c1", "load", "chat", lora_path="/a/chat"))
    assert (loaded.command_id, loaded.op, loaded.digest) == ("c1", "done", "digest-of-/a/chat")
    assert adapters.held()["chat"] == "digest-of-/a/chat"
    assert run_command(adapters, AdapterCommand("c2", "unload", "chat")).op == "done"
    missing = run_command(adapters, AdapterCommand("c3", "unload", "chat"))
    assert (missing.op, missing.code) == ("failed", "model_not_found")
