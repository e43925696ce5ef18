"""Prefix reuse end to end: a 5-turn chat over the openai SDK, cache on vs off, hybrid and cluster.

Every reply must be byte-identical to a hybrid node with ``--prefix-cache-bytes 0``;
turns 2-5 must be served partly from a cache (``usage.prompt_tokens_details``,
``/metrics``). The cluster runs once with a prefill node for every turn and once
with decode-local prefill of short misses, then across a decode node restart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin import openblas
from mlxcel_plugin.local_cluster import LocalCluster, start_node

STARTUP_TIMEOUT_S = 180
MODEL = "tiny"
TURNS = 5
SYSTEM = " ".join(f"Rule {i}: answer with care about topic {i * 7 % 31}." for i in range(120))
pytestmark = pytest.mark.timeout(900)


def conversation(base_url: str, after_turn=lambda: None, system: str = SYSTEM,
                 turns_asked: int = TURNS) -> list[tuple[str, int]]:
    """(reply, cached prompt tokens) per turn; each turn carries the whole history."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                           timeout=300)
    messages = [{"role": "system", "content": system}]
    turns = []
    for turn in range(turns_asked):
        messages.append({"role": "user", "content": f"Question {turn}: what about item {turn}?"})
        response = client.chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=12, temperature=0)
        reply = response.choices[0].message.content
        details = response.usage.prompt_tokens_details
        turns.append((reply, details.cached_tokens if details else 0))
        messages.append({"role": "assistant", "content": reply})
        after_turn()
    return turns


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def hybrid_run(workdir: Path, model: str, cache_bytes: int,
               **chat: object) -> tuple[list[tuple[str, int]], float]:
    node = start_node("hybrid", workdir, ["--model", model, "--served-model-name", MODEL,
                                          "--no-warmup", "--prefix-cache-bytes", str(cache_bytes)])
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        turns = conversation(node.url, **chat)
        return turns, counter(node.url, "mlxcel:prefix_cache_hit_tokens_total")
    finally:
        node.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path, tmp_path_factory) -> list[str]:
    turns, hits = hybrid_run(tmp_path_factory.mktemp("ref"), str(tiny_model_path), 0)
    assert hits == 0 and all(cached == 0 for _, cached in turns)
    return [reply for reply, _ in turns]


def start_cluster(workdir: Path, model: str, local_prefill_tokens: int) -> LocalCluster:
    toml = workdir / "cluster.toml"
    workdir.mkdir(parents=True, exist_ok=True)
    toml.write_text(f"[prefix_cache]\nlocal_prefill_tokens = {local_prefill_tokens}\n"
                    '[server]\nprefill_balancer = "prefix-aware"\n'
                    'decode_balancer = "prefix-aware"\n')
    cluster = LocalCluster(workdir=workdir, model=model, prefill_count=1, decode_count=1,
                           common_args=["--served-model-name", MODEL, "--no-warmup",
                                        "--distributed-config", str(toml)])
    return cluster.start(STARTUP_TIMEOUT_S)


def router_stats(cluster: LocalCluster) -> dict:
    return httpx.get(f"{cluster.router.url}/router/stats", timeout=10).json()


def test_hybrid_hits_on_later_turns_and_matches_cache_off(tiny_model_path, tmp_path,
                                                          reference) -> None:
    turns, hits = hybrid_run(tmp_path, str(tiny_model_path), 1 << 30)
    assert [reply for reply, _ in turns] == reference
    assert turns[0][1] == 0 and all(cached > 0 for _, cached in turns[1:])
    assert hits == sum(cached for _, cached in turns)


def test_cluster_through_prefill_nodes_matches_cache_off(tiny_model_path, tmp_path,
                                                         reference) -> None:
    cluster = start_cluster(tmp_path, str(tiny_model_path), local_prefill_tokens=0)
    try:
        prefill = cluster.pool("prefill")[0]
        shipped: list[float] = []  # KV bytes the prefill node handed off, after each turn
        turns = conversation(cluster.router.url, lambda: shipped.append(
            counter(prefill.url, "mlxcel:handoff_bytes_sum")))
        assert [reply for reply, _ in turns] == reference
        # Turn 1 ships the whole cache; later turns only what the decode node lacks (delta).
        per_turn = [b - a for a, b in zip([0.0, *shipped], shipped, strict=False)]
        assert per_turn[0] > 0 and all(0 < b < 0.5 * per_turn[0] for b in per_turn[1:]), per_turn
        assert counter(prefill.url, "mlxcel:handoff_prefix_missing_total") == 0
        assert all(cached > 0 for _, cached in turns[1:])
        assert counter(prefill.url, "mlxcel:prefix_cache_hit_tokens_total") > 0
        assert counter(cluster.router.url, "mlxcel:prompt_cached_tokens_total") > 0
        assert router_stats(cluster)["metrics"]["local_prefills"] == 0
    finally:
        cluster.stop()


@pytest.fixture
def local_cluster(tiny_model_path, tmp_path) -> Iterator[LocalCluster]:
    cluster = start_cluster(tmp_path, str(tiny_model_path), local_prefill_tokens=2048)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_decode_prefills_short_misses_itself_and_survives_a_restart(local_cluster,
                                                                    reference) -> None:
    turns = conversation(local_cluster.router.url)
    assert [reply for reply, _ in turns] == reference
    assert all(cached > 0 for _, cached in turns[1:])
    metrics = router_stats(local_cluster)["metrics"]
    assert metrics["local_prefills"] == TURNS - 1  # turn 1 needs the prefill node
    decode = local_cluster.pool("decode")[0]
    assert counter(decode.url, "mlxcel:prefix_cache_hit_tokens_total") > 0

    # A restarted decode node holds nothing: the router forgets what it held, and
    # the same conversation is still answered exactly.
    decode.stop()
    local_cluster.nodes.remove(decode)
    fresh = local_cluster.start_engine_node("decode", serving_bind=decode.serving_bind)
    fresh.wait_healthy(STARTUP_TIMEOUT_S)
    deadline = time.monotonic() + 60
    while router_stats(local_cluster)["nodes"]["decode"][0]["health"] != "healthy":
        assert time.monotonic() < deadline, "the router never reconnected to the new node"
        time.sleep(0.1)  # the router redials with backoff
    assert router_stats(local_cluster)["nodes"]["decode"][0]["prefix_blocks"] == 0
    again = conversation(local_cluster.router.url)
    assert [reply for reply, _ in again] == reference


@pytest.mark.smollm2
def test_smollm2_nodes_reuse_any_prompt_token_and_match_cache_off(smollm2_model_path, tmp_path):
    """On SmolLM2 the nodes' probe allows any-token reuse (AVX-512 CPUs, OpenBLAS unpinned).

    The reuse then resumes mid-chunk, after the previous prompt but its last token;
    every reply is still the cache-off node's.
    """
    chat = {"system": SYSTEM[:1200], "turns_asked": 3}
    with ThreadPoolExecutor(2) as both:  # the two nodes start and converse side by side
        runs = [both.submit(hybrid_run, tmp_path, str(smollm2_model_path), cache_bytes, **chat)
                for cache_bytes in (0, 1 << 30)]
        (plain, _), (cached, hits) = (run.result() for run in runs)
    assert [reply for reply, _ in cached] == [reply for reply, _ in plain]
    assert hits == sum(tokens for _, tokens in cached) > 0
    if not openblas.has_avx512(openblas.read_cpu_flags()):
        pytest.skip("no AVX-512: the probe's answer depends on this machine's kernels")
    if os.environ.get("OPENBLAS_CORETYPE") or os.environ.get("OPENBLAS_L2_SIZE"):
        # docs/blas.md: a pin (Haswell, say) may allow whole cells only
        pytest.skip("the environment pins OpenBLAS: the probe's answer is its kernels'")
    assert any(tokens % 128 for _, tokens in cached[1:])  # mid-chunk: not whole chunks
