"""``prompt_cache_key`` steers a real router (127.0.0.1): one prefill node, two decode nodes,
prefix-aware balancers, fake engines. Prompts shorter than one prefix block give the
router's index nothing to match, so without the key each idle decode node is an equal
choice (a random tie); with it, every request of one key lands on one decode node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.local_cluster import LocalCluster

STARTUP_TIMEOUT_S = 240
MODEL = "tiny"
REQUESTS_PER_KEY = 8  # a random placement puts all of them on one node with p = 1/128
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, tmp_path_factory) -> Iterator[LocalCluster]:
    balancers = ["--prefill-balancer", "prefix-aware", "--decode-balancer", "prefix-aware"]
    cluster = LocalCluster(workdir=tmp_path_factory.mktemp("cache-key"),
                           model=str(tiny_model_path), prefill_count=1, decode_count=2,
                           common_args=["--engine", "fake", "--served-model-name", MODEL,
                                        "--no-warmup"],
                           router_args=balancers)  # fmt: skip
    cluster.start(STARTUP_TIMEOUT_S)
    try:
        yield cluster
    finally:
        cluster.stop()


def decode_dispatched(cluster: LocalCluster) -> dict[str, int]:
    stats = httpx.get(f"{cluster.router.url}/router/stats", timeout=10).json()
    return {entry["id"]: entry["dispatched"] for entry in stats["nodes"]["decode"]}


def sent_to(cluster: LocalCluster, call: object, key: str) -> set[str]:
    """The decode nodes that got ``call``'s requests with ``key`` (sent one at a time)."""
    before = decode_dispatched(cluster)
    for index in range(REQUESTS_PER_KEY):
        call(key, index)
    after = decode_dispatched(cluster)
    return {node for node, count in after.items() if count > before.get(node, 0)}


def test_one_key_one_decode_node_through_chat_and_responses(cluster) -> None:
    with openai.OpenAI(base_url=f"{cluster.router.url}/v1", api_key="none", max_retries=0,
                       timeout=60) as client:  # fmt: skip
        def chat(key: str, index: int) -> None:
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": f"turn {index}"}], extra_body={
                    "prompt_cache_key": key})  # fmt: skip

        def respond(key: str, index: int) -> None:
            client.responses.create(model=MODEL, input=f"turn {index}", max_output_tokens=2,
                                    prompt_cache_key=key, store=False)  # fmt: skip

        for name, call in (("chat", chat), ("responses", respond)):
            for key in (f"{name}-a", f"{name}-b"):
                nodes = sent_to(cluster, call, key)
                assert len(nodes) == 1, (name, key, nodes)
