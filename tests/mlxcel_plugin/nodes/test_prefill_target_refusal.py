"""A prefill node hands off only to a decode node whose announced profile can take its KV.

In process (fake engine, stub links): the router's ``decode_target`` announces
another layer count in its link verdict; the prefill node learns that before
the prefill starts, sends no KV at all, and after the first token reports the
named code ``decode_target_incompatible`` (the router places the request on
another pair). A compatible target gets its handoff as before.
"""

from __future__ import annotations

import asyncio

from mlxcel_plugin.builtin_plugin import TRANSFER_STRATEGIES, builtin_codecs
from mlxcel_plugin.compatibility import KVProfile, NodeProfile
from mlxcel_plugin.link.protocol.frames import ErrorFrame, Frame, FrameType, Request, Result
from mlxcel_plugin.nodes.decode_targets import INCOMPATIBLE
from mlxcel_plugin.nodes.prefill_job import PrefillNodeParts
from mlxcel_plugin.nodes.prefill_node import PrefillNode
from mlxcel_plugin.scheduling import PrefillSchedulerConfig
from mlxcel_plugin.testing.fake_engine import FakeEngine
from mlxcel_plugin.transfer import TransferConfig

STRATEGIES = {strategy.name: strategy for strategy in TRANSFER_STRATEGIES}
DEADLINE_S = 10.0


class _Link:
    def __init__(self, announce: dict[str, str]):
        self.peer_announce = announce


class StubLinks:
    """Links to decode nodes: each target's verdict; handoffs recorded, never sent."""

    def __init__(self, announces: dict[str, dict[str, str]]):
        self.announces, self.started, self.dialed = announces, [], []

    async def lanes(self, target: str, count: int) -> list[_Link]:
        self.dialed.append(target)
        return [_Link(self.announces[target])] * count

    def start(self, handoff, lanes: int) -> None:
        self.started.append(handoff)

    def speaks(self, target: str, serde_version: int) -> bool:
        return False

    async def cancel_on_target(self, handoff, reason: str) -> None:
        return None

    async def close(self) -> None:
        return None


class Owner:
    def __init__(self):
        self.frames: list[Frame] = []

    def put(self, frame: Frame) -> None:
        self.frames.append(frame)


def announce(engine: FakeEngine, layers: int) -> dict[str, str]:
    fingerprint = {**engine.info.fingerprint, "num_layers": layers,
                   "cache_classes": ["KVCache"] * layers}
    return NodeProfile(KVProfile.from_fingerprint(fingerprint)).to_announce()


def run_one(target_layers: int) -> tuple[list[Frame], StubLinks]:
    engine = FakeEngine()
    own = engine.info.fingerprint["num_layers"]
    links = StubLinks({"decode-a:1": announce(engine, target_layers)})
    parts = PrefillNodeParts(engine=engine, scheduler_config=PrefillSchedulerConfig(),
                             transfer_config=TransferConfig(strategy="full", codec="none"),
                             strategies=STRATEGIES, codecs=builtin_codecs())
    node = PrefillNode(parts, links, "prefill-1", env={})
    owner = Owner()
    request = Request("r1", list(range(1, 9)), max_tokens=4, decode_target="decode-a:1")

    async def go() -> None:
        engine.start()
        node._on_request(owner, Request.from_frame(request.to_frame()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        done = own == target_layers and links.started
        while not done and loop.time() < deadline:  # bounded poll
            await asyncio.sleep(0.01)
            done = any(f.type is FrameType.ERROR for f in owner.frames) or (
                own == target_layers and links.started)
        await node.close()

    try:
        asyncio.run(go())
    finally:
        engine.close()
    return owner.frames, links


def test_an_incompatible_target_gets_no_kv_and_the_refusal_is_named() -> None:
    frames, links = run_one(target_layers=6)
    assert links.dialed == ["decode-a:1"]  # its profile, read before the prefill
    assert links.started == []  # no handoff, not even a begin
    first, error = frames
    assert Result.from_frame(first).seq == 0  # the first token went out
    refusal = ErrorFrame.from_frame(error)
    assert refusal.code == INCOMPATIBLE and "layer_count_mismatch" in refusal.message


def test_a_compatible_target_gets_its_handoff() -> None:
    engine_layers = FakeEngine().info.fingerprint["num_layers"]
    frames, links = run_one(target_layers=engine_layers)
    assert len(links.started) == 1
    # (the node closing then cancels that handoff: no acks come from stub links)
    assert not any(ErrorFrame.from_frame(f).code == INCOMPATIBLE for f in frames
                   if f.type is FrameType.ERROR)
