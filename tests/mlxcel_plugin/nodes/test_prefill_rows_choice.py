"""A prefill node has the engine copy each cell's rows only for a handoff whose strategy
sends them ahead of their layers: ``auto`` decides before prefill starts."""

import asyncio
import time

import pytest

from mlxcel_plugin.builtin_plugin import TRANSFER_STRATEGIES, builtin_codecs
from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.nodes.prefill_job import NodeJob, PrefillNodeParts
from mlxcel_plugin.nodes.prefill_node import PrefillNode
from mlxcel_plugin.scheduling import PrefillSchedulerConfig
from mlxcel_plugin.testing.fake_engine import FakeEngine
from mlxcel_plugin.transfer import TransferConfig

STRATEGIES = {strategy.name: strategy for strategy in TRANSFER_STRATEGIES}


class RowsEngine(FakeEngine):
    """Records whether each prefill asked for cells' rows; runs nothing."""

    def __init__(self, offers_rows: bool):
        super().__init__()
        self.streams_prefill_rows = offers_rows
        self.asked_rows: list[bool] = []

    def prefill(self, request, on_done, on_layer=None, on_rows=None):
        self.asked_rows.append(on_rows is not None)


class StubLinks:
    def __init__(self):
        self.started = []

    def start(self, handoff, lanes):
        self.started.append(handoff)

    def speaks(self, target, serde_version):
        return False


def start_one(strategy: str, prompt_tokens: int, offers_rows: bool = True):
    engine = RowsEngine(offers_rows)
    parts = PrefillNodeParts(engine=engine, scheduler_config=PrefillSchedulerConfig(),
                             transfer_config=TransferConfig(strategy=strategy, codec="none"),
                             strategies=STRATEGIES, codecs=builtin_codecs())
    node = PrefillNode(parts, StubLinks(), "prefill-1", env={})
    request = GenerationRequest("r1", tuple(range(prompt_tokens)), max_tokens=4)
    job = NodeJob(request, owner=None, target="decode-1", pinned=True,
                  submitted_s=time.monotonic())

    async def go():
        node._start_prefill(job)
        await asyncio.sleep(0)

    try:
        asyncio.run(go())
    finally:
        node.encoder.shutdown(wait=True)
    return engine.asked_rows, job.choice.strategy


def tokens_for(payload_bytes: int) -> int:
    per_token = PrefillNode(PrefillNodeParts(
        engine=FakeEngine(), scheduler_config=PrefillSchedulerConfig(),
        transfer_config=TransferConfig(), strategies=STRATEGIES, codecs=builtin_codecs()),
        StubLinks(), "probe", env={}).fingerprint.kv_bytes(1)
    return payload_bytes // per_token + 1


@pytest.mark.parametrize(("strategy", "payload", "asked", "chosen"), [
    ("auto", 1 << 20, False, "full"),  # a small payload goes whole: no rows copied
    ("auto", 64 << 20, True, "streamed"),
    ("full", 64 << 20, False, "full"),
    ("streamed", 1 << 20, True, "streamed"),
    ("layer-parallel", 1 << 20, True, "layer-parallel"),
])
def test_rows_are_asked_for_only_when_the_chosen_strategy_sends_them(strategy, payload, asked,
                                                                       chosen):
    assert start_one(strategy, tokens_for(payload)) == ([asked], chosen)


def test_an_engine_without_rows_is_never_asked_for_them():
    assert start_one("streamed", tokens_for(1 << 20), offers_rows=False) == ([False], "streamed")
