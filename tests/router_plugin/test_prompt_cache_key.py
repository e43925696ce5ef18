"""``prompt_cache_key`` as a routing hint: the prefix index remembers where a key went, the
prefix-aware balancer prefers that node when the tokens do not decide, and the key travels
from the chat and Responses bodies into the request the cluster places."""

from __future__ import annotations

import random

import httpx
import pytest

from mlxcel_plugin.balancer_api import NodeView, RequestInfo
from mlxcel_plugin.engine_api import GenerationRequest
from router_plugin.balancers.prefix_aware import BALANCE_ABS_REQUESTS, PrefixAwareBalancer
from router_plugin.cluster.prefix_index import PrefixIndex
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app

REQUEST = RequestInfo("r", 10, 8, cache_key="agent-1")


def nodes(*specs: tuple[int, int, bool]) -> list[NodeView]:
    """(in_flight, cached_prefix_tokens, holds_cache_key) per node."""
    return [NodeView(f"n{i}", f"127.0.0.1:{9000 + i}", in_flight=load,
                     cached_prefix_tokens=cached, holds_cache_key=keyed)
            for i, (load, cached, keyed) in enumerate(specs)]  # fmt: skip


def picks(views: list[NodeView]) -> set[str]:
    """Every node the balancer picks over many seeds (its ties are random)."""
    return {PrefixAwareBalancer(random.Random(seed)).select(views, REQUEST).node_id
            for seed in range(40)}  # fmt: skip


def test_the_key_decides_when_no_node_holds_the_prompt() -> None:
    assert picks(nodes((0, 0, False), (1, 0, True), (0, 0, False))) == {"n1"}
    assert picks(nodes((0, 0, False), (1, 0, False), (0, 0, False))) == {"n0", "n2"}


def test_the_key_breaks_a_tie_of_equal_prefixes() -> None:
    assert picks(nodes((0, 256, False), (2, 256, True))) == {"n1"}


def test_a_longer_cached_prefix_beats_the_key() -> None:
    assert picks(nodes((0, 384, False), (0, 128, True))) == {"n0"}


def test_an_overloaded_key_holder_is_passed_over() -> None:
    busy = BALANCE_ABS_REQUESTS + 1
    assert picks(nodes((0, 0, False), (busy, 0, True))) == {"n0"}


def test_the_index_remembers_the_last_node_per_key_and_forgets_a_lost_node() -> None:
    index = PrefixIndex(block_tokens=4)
    assert index.key_node("k") is None and index.key_node(None) is None
    index.record_key("k", "prefill-0")
    index.record_key(None, "prefill-1")  # no key: nothing to remember
    assert index.key_node("k") == "prefill-0"
    index.record_key("k", "prefill-1")
    assert index.key_node("k") == "prefill-1"
    index.forget("prefill-1")
    assert index.key_node("k") is None



@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_key_reaches_the_request_from_chat_and_responses(
        text_tokenizer, make_engine) -> None:  # fmt: skip
    seen: list[GenerationRequest] = []

    def script(request: GenerationRequest) -> list[int]:
        seen.append(request)
        return text_tokenizer.encode("Hi.", add_special_tokens=False) + [2]

    app = make_app(LocalEngineBackend(make_engine(script)), text_tokenizer, "tiny")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        user = [{"role": "user", "content": "Hi"}]
        assert (await c.post("/v1/chat/completions", json={
            "messages": user, "prompt_cache_key": "agent-1"})).status_code == 200
        assert (await c.post("/v1/responses", json={
            "input": "Hi", "prompt_cache_key": "agent-2"})).status_code == 200
        assert (await c.post("/v1/chat/completions", json={"messages": user})).status_code == 200
        bad = await c.post("/v1/chat/completions", json={"messages": user, "prompt_cache_key": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_key"
    assert [r.cache_key for r in seen] == ["agent-1", "agent-2", None]
