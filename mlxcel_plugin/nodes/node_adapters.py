"""A prefill or decode node's LoRA adapters: announced, checked per request, loaded on command.

The node announces what its engine holds (name -> digest of the adapter's files)
in every TELEMETRY, so the router routes an adapter's requests only to nodes
holding it, and sees a load or unload within one telemetry interval. A REQUEST
(or claim) naming an adapter the node does not hold at that digest is refused
before any work with ``adapter_not_loaded``: the K/V depend on every byte of
the adapter. ADAPTER frames from a router load or unload one on the engine
thread (``engines/lora/engine.py``), answered with the same frame type.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from mlxcel_plugin.errors import InvalidRequestError, MlxcelError
from mlxcel_plugin.link.protocol.frames import AdapterCommand, Frame

logger = logging.getLogger(__name__)


class AdapterNotLoaded(MlxcelError):
    """A request for an adapter this node does not hold (or holds another version of)."""

    status_code = 404
    code = "adapter_not_loaded"


class NodeAdapters:
    def __init__(self, engine: Any):
        self.engine = engine
        self._tasks: set[asyncio.Task[None]] = set()

    def held(self) -> dict[str, str]:
        """name -> digest of every adapter a new request may name here."""
        digests = getattr(self.engine, "adapter_digests", None)
        return dict(digests()) if digests is not None else {}

    def check(self, name: str | None, digest: str | None) -> None:
        """Refuse a request whose adapter this node does not hold at ``digest``."""
        if name is None:
            return
        held = self.held().get(name)
        if held is None:
            raise AdapterNotLoaded(f"this node does not hold the adapter {name!r}")
        if digest and held != digest:
            raise AdapterNotLoaded(f"this node holds the adapter {name!r} at digest {held}, "
                                   f"not {digest}")  # fmt: skip

    def on_command(self, command: AdapterCommand, reply: Callable[[Frame], None]) -> None:
        """Run a router's load/unload off the event loop; the reply goes when it is done."""
        task = asyncio.get_running_loop().create_task(self._run(command, reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, command: AdapterCommand, reply: Callable[[Frame], None]) -> None:
        try:
            digest = await asyncio.to_thread(self._apply, command)
        except MlxcelError as exc:
            reply(command.reply(error=exc.message, code=exc.code or "error").to_frame())
            return
        logger.info("adapter %s %sed (digest %s)", command.lora_name, command.op, digest or "-")
        reply(command.reply(digest=digest).to_frame())

    def _apply(self, command: AdapterCommand) -> str:
        if not hasattr(self.engine, "load_adapter"):
            raise InvalidRequestError("this node serves no LoRA adapters: start it with "
                                      "--enable-lora or --adapter", param="lora_name")  # fmt: skip
        if command.op == "load":
            return self.engine.load_adapter(command.lora_name, command.lora_path)
        if command.op == "unload":
            self.engine.unload_adapter(command.lora_name)
            return ""
        raise InvalidRequestError(f"a node takes no ADAPTER {command.op!r}", param="op")
