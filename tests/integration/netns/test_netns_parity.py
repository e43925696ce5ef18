"""Parity with hybrid when router, prefill and decode are separate hosts (1 Gbit/s links).

Tiny checkpoint, engine ``mlx``. One prefill node per transfer strategy hands
off to one decode node across namespaces; driven link-level from the root
namespace (``LinkDriver``), the greedy tokens equal single-process
``generate``. Then a real router in its own namespace, round-robin over the
three prefill nodes, answers chat requests byte for byte like a hybrid node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from mlxcel_plugin.testing.link_driver import LinkDriver
from tests.integration.netns.conftest import netns_cluster
from tests.integration.test_nodes import prompt_of, reference
from tests.integration.test_router_cluster import MESSAGES, MODEL, normalize

STRATEGIES = ("full", "streamed", "layer-parallel")
PROMPT_LENGTHS = (255, 700)
STARTUP_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_path) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("netns-parity")
    model = ["--model", str(tiny_model_path), "--no-warmup", "--served-model-name", MODEL]
    with netns_cluster(workdir, ("router", "prefill", "decode")) as nodes:
        decode = nodes.start("decode", "decode", "decode", model)
        prefills = {
            strategy: nodes.start("prefill", "prefill", f"prefill-{strategy}", model,
                                  f'[transfer]\nstrategy = "{strategy}"\ncodec = "none"\n'
                                  "parallelism = 2\nchunk_bytes = 65536\n")
            for strategy in STRATEGIES
        }
        router = nodes.start("router", "router", "router", [
            *model, "--prefill-balancer", "round-robin",
            "--prefill-peers", ",".join(p.serving_bind for p in prefills.values()),
            "--decode-peers", decode.serving_bind])
        hybrid = nodes.start("router", "hybrid", "hybrid", model)
        nodes.wait_all(STARTUP_TIMEOUT_S)
        yield {"nodes": nodes, "decode": decode, "prefills": prefills, "router": router,
               "hybrid": hybrid}


@pytest.fixture(scope="module")
def expected(tiny_model_path) -> dict[str, list[int]]:
    return reference(tiny_model_path, [
        {"request_id": f"len{n}", "prompt": prompt_of(n), "max_tokens": 6}
        for n in PROMPT_LENGTHS])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_output_across_namespaces_matches_hybrid(cluster, expected, strategy):
    prefill, decode = cluster["prefills"][strategy], cluster["decode"]

    async def go() -> dict[str, list[int]]:
        async with LinkDriver(cluster["nodes"].secret, prefill.serving_bind,
                              decode.serving_bind) as driver:
            got = {}
            for n in PROMPT_LENGTHS:
                outcome = await driver.generate(f"len{n}-{strategy}", prompt_of(n), 6)
                assert outcome.ok, outcome
                got[f"len{n}"] = outcome.tokens
            return got

    assert asyncio.run(go()) == expected


def test_the_router_across_namespaces_answers_like_hybrid(cluster):
    cases = [{"messages": MESSAGES, "max_tokens": 12},
             {"messages": MESSAGES, "max_tokens": 12, "stream": True},
             {"messages": MESSAGES, "max_tokens": 12, "temperature": 0.8, "seed": 7}]

    def answers(node) -> list[str]:
        with httpx.Client(timeout=300) as http:
            out = []
            for body in cases:  # round robin: one request per prefill node (strategy)
                response = http.post(f"{node.url}/v1/chat/completions",
                                     json={"model": MODEL, **body})
                assert response.status_code == 200, response.text
                out.append(normalize(response.text))
            return out

    assert answers(cluster["router"]) == answers(cluster["hybrid"])
