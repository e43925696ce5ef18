"""Which nodes a request on a LoRA adapter may use, from what the nodes announce (pure)."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.errors import ModelNotFoundError
from mlxcel_plugin.link.protocol.frames import Request
from mlxcel_plugin.testing.fake_peers import EOS, echo_script
from router_plugin.cluster.adapter_routing import (
    ServedAdapters,
    adapter_placement,
    with_adapter,
)
from router_plugin.cluster.node_pool import NodePool, NodeTelemetry
from router_plugin.cluster.prefix_index import prompt_blocks
from router_plugin.cluster.routed_request import RoutedRequest
from tests.router_plugin.cluster.test_routed_request import router, run_request

NOW = 10.0


def pool_with(adapters: dict[str, dict[str, str]]) -> NodePool:
    """prefill-0, decode-0, decode-1, healthy, each announcing ``adapters[node_id]``."""
    pool = NodePool.from_peers(["10.0.0.1:7001"], ["10.0.0.2:7002", "10.0.0.3:7002"])
    for node_id in pool.ids():
        pool.mark_healthy(node_id, NOW)
        pool.update_telemetry(node_id, NodeTelemetry(adapters=adapters.get(node_id, {})), NOW)
    return pool


def test_a_request_on_an_adapter_leaves_out_every_node_without_it():
    pool = pool_with({"prefill-0": {"sql": "d1"}, "decode-0": {"sql": "d1"}})
    assert adapter_placement(pool, "sql", NOW) == ("d1", {"decode-1"})
    assert adapter_placement(pool, None, NOW) == (None, set())  # the base: every node


def test_the_pair_must_hold_one_digest():
    pool = pool_with({"prefill-0": {"sql": "d2"}, "decode-0": {"sql": "d1"},
                      "decode-1": {"sql": "d2"}})  # fmt: skip
    assert adapter_placement(pool, "sql", NOW) == ("d2", {"decode-0"})


@pytest.mark.parametrize("adapters", [
    {"decode-0": {"sql": "d1"}},  # no prefill node holds it
    {"prefill-0": {"sql": "d1"}},  # no decode node holds it
    {"prefill-0": {"sql": "d1"}, "decode-0": {"sql": "d2"}},  # not at one digest
])  # fmt: skip
def test_no_pair_is_model_not_found(adapters):
    with pytest.raises(ModelNotFoundError):
        adapter_placement(pool_with(adapters), "sql", NOW)


def test_stale_or_unhealthy_announcements_do_not_count():
    pool = pool_with({"prefill-0": {"sql": "d1"}, "decode-0": {"sql": "d1"}})
    pool.mark_unreachable("decode-0", NOW, "gone")
    with pytest.raises(ModelNotFoundError):
        adapter_placement(pool, "sql", NOW)
    pool.mark_healthy("decode-0", NOW)
    with pytest.raises(ModelNotFoundError):
        adapter_placement(pool, "sql", NOW + 60)  # telemetry too old to trust


def test_a_node_reply_is_routable_at_once_and_an_unload_at_once_too():
    pool = pool_with({"prefill-0": {"sql": "d1"}})
    pool.note_adapter("decode-1", "sql", "d1")
    assert adapter_placement(pool, "sql", NOW) == ("d1", {"decode-0"})
    pool.note_adapter("decode-1", "sql", None)
    with pytest.raises(ModelNotFoundError):
        adapter_placement(pool, "sql", NOW)


def test_the_front_lists_adapters_a_pair_announces():
    pool = pool_with({"prefill-0": {"sql": "d1", "chat": "d3"}, "decode-1": {"sql": "d1"}})
    served = ServedAdapters(pool, "tiny", lambda: NOW)
    assert dict(served) == {"sql": "tiny"} and "chat" not in served


def test_frames_name_the_adapter_and_a_base_frame_is_unchanged():
    frame = Request("r1", [1, 2, 3])
    assert with_adapter(frame, None, None) is frame
    named = with_adapter(frame, "sql", "d1")
    assert (named.adapter, named.adapter_digest) == ("sql", "d1")


def test_prefix_blocks_of_an_adapter_are_keyed_apart():
    tokens = list(range(300))
    assert prompt_blocks(tokens, 128) == prompt_blocks(tokens, 128, None)
    assert set(prompt_blocks(tokens, 128)).isdisjoint(prompt_blocks(tokens, 128, "sql"))
    assert prompt_blocks(tokens, 128, "sql") != prompt_blocks(tokens, 128, "chat")


def test_a_node_that_no_longer_holds_the_adapter_is_left_for_another() -> None:
    """Its announcement was stale: adapter_not_loaded re-places the request elsewhere."""

    async def main():
        r = await router()
        r.prefills[0].error_code = "adapter_not_loaded"  # the node's own, named refusal
        request = GenerationRequest("r1", (5, 6, 7), 50, stop_token_ids=(EOS,))
        events = await run_request(RoutedRequest(r.context(), request))
        assert [e.token_id for e in events] == echo_script((5, 6, 7))
        assert r.stats.requests.rerouted == 1
        await r.close()

    asyncio.run(asyncio.wait_for(main(), 30))
