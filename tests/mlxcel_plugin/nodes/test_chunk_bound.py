"""How large a prefill node's chunks are: raw ones up to 32 MiB towards a decode node that
announced serde v5 (the begin then says v5), one record's 8 MiB − 64 KiB towards any other
and for codecs that transform the bytes."""

import asyncio
import time

import pytest

from mlxcel_plugin.builtin_plugin import TRANSFER_STRATEGIES, builtin_codecs
from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.kv_serde import DEFAULT_MAX_BODY_BYTES
from mlxcel_plugin.kv_serde.versions import (
    AEAD_ONLY_SERDE_VERSION,
    LARGE_CHUNK_BYTES,
    LARGE_CHUNK_SERDE_VERSION,
)
from mlxcel_plugin.nodes.prefill_job import NodeJob, PrefillNodeParts
from mlxcel_plugin.nodes.prefill_node import PrefillNode
from mlxcel_plugin.scheduling import PrefillSchedulerConfig
from mlxcel_plugin.testing.fake_engine import FakeEngine
from mlxcel_plugin.transfer import TransferConfig

STRATEGIES = {strategy.name: strategy for strategy in TRANSFER_STRATEGIES}


class AnnouncingLinks:
    """Links to a decode node that announced ``versions``; handoffs are kept, not sent."""

    def __init__(self, versions: set[int]):
        self.versions, self.started = versions, []

    def start(self, handoff, lanes):
        self.started.append(handoff)

    def speaks(self, target, serde_version):
        return serde_version in self.versions


def begin_one(versions: set[int], chunk_bytes: int = LARGE_CHUNK_BYTES, codec: str = "none"):
    """(the begin header as sent, the strategy's chunk and body bounds, /health's choice)."""
    links = AnnouncingLinks(versions)
    transfer = TransferConfig(strategy="full", codec=codec, allow_lossy=True,
                              chunk_bytes=chunk_bytes)
    parts = PrefillNodeParts(engine=FakeEngine(), scheduler_config=PrefillSchedulerConfig(),
                             transfer_config=transfer,
                             strategies=STRATEGIES, codecs=builtin_codecs())
    node = PrefillNode(parts, links, "prefill-1", env={})
    job = NodeJob(GenerationRequest("r1", tuple(range(64)), max_tokens=4), owner=None,
                  target="decode-1", pinned=True, submitted_s=time.monotonic())

    async def go():
        starter = node.starter
        handoff = starter.begin(job, 1, starter.select(job, streaming=False), streaming=False)
        return handoff.header.to_dict(), handoff.strategy.options, starter.last_choice

    try:
        return asyncio.run(go())
    finally:
        node.encoder.shutdown(wait=True)


def test_a_decode_node_announcing_v5_gets_chunks_up_to_32_mib_and_a_v5_begin():
    begin, options, choice = begin_one({AEAD_ONLY_SERDE_VERSION, LARGE_CHUNK_SERDE_VERSION})
    assert options.chunk_bytes == options.max_body_bytes == LARGE_CHUNK_BYTES
    assert begin["version"] == LARGE_CHUNK_SERDE_VERSION
    assert (choice["chunk_bytes"], choice["serde_version"]) == (LARGE_CHUNK_BYTES, 5)


@pytest.mark.parametrize("versions", [set(), {AEAD_ONLY_SERDE_VERSION}], ids=["v1", "v4"])
def test_an_older_decode_node_gets_chunks_within_one_record(versions):
    begin, options, choice = begin_one(versions)
    assert options.chunk_bytes == options.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert begin["version"] == max(versions, default=1)
    assert (choice["chunk_bytes"], choice["serde_version"]) == (DEFAULT_MAX_BODY_BYTES,
                                                                begin["version"])


@pytest.mark.parametrize("codec", ["int8", "lz4"])
def test_a_coded_handoff_keeps_record_sized_chunks_for_its_pipeline(codec):
    begin, options, _ = begin_one({AEAD_ONLY_SERDE_VERSION, LARGE_CHUNK_SERDE_VERSION},
                                  codec=codec)
    assert options.chunk_bytes == options.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert begin["version"] < LARGE_CHUNK_SERDE_VERSION


def test_a_configured_chunk_size_is_kept_below_the_bound():
    _, options, _ = begin_one({LARGE_CHUNK_SERDE_VERSION}, chunk_bytes=1 << 20)
    assert (options.chunk_bytes, options.max_body_bytes) == (1 << 20, LARGE_CHUNK_BYTES)


def test_a_chunk_size_above_what_any_receiver_takes_is_a_config_error():
    with pytest.raises(ConfigError, match="chunk_bytes"):
        TransferConfig(chunk_bytes=LARGE_CHUNK_BYTES + 1)
