"""``[speculative] method = "ngram"`` (and a draft model, asked for per request) on a hybrid
node and on a prefill + decode cluster: the same replies through the openai SDK, and the
same speculation choices.

With one request at a time and the row cost fixed (``learn_row_cost = false``: learned,
each node weighs rows by its own timings) the adaptive rule is a pure function of the
tokens, so the decode node proposes, accepts and rejects exactly what the hybrid node does; equal
``mlxcel:spec_*`` counters show it, beside equal replies (greedy and seeded, streamed
and not, a request that turns speculation off, requests that ask for the draft: the
decode node prefills the draft itself from the handed-off prompt). The router's
``/router/stats`` shows the decode node's totals per method.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.local_cluster import LocalCluster, start_node
from tests.engines.speculative.drafts import noisy_copy

STARTUP_TIMEOUT_S = 180
MODEL = "tiny"
REPEATED = " ".join(["def add(a, b):\n    return a + b\n"] * 6)
PROMPTS = [REPEATED, "the fox ran over the hill and " * 8, "List the numbers: 1, 2, 3,",
           "Edit the function:\n" + REPEATED]
SPEC_TOML = '[speculative]\nmethod = "ngram"\nlearn_row_cost = false\n'
pytestmark = pytest.mark.timeout(900)


def replies(url: str) -> list[str]:
    out = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300) as c:
        for prompt in PROMPTS:
            done = c.completions.create(model=MODEL, prompt=prompt, max_tokens=48)
            out.append(done.choices[0].text)
        seeded = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32,
                                      temperature=0.8, seed=5)
        out.append(seeded.choices[0].text)
        off = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24,
                                   extra_body={"speculative": "off"})
        out.append(off.choices[0].text)
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=32,
            stream=True)
        out.append("|".join(chunk.choices[0].delta.content or "" for chunk in stream
                            if chunk.choices))
        out += draft_replies(c)
    return out


def draft_replies(client: openai.OpenAI) -> list[str]:
    draft = {"speculative": "draft"}
    out = [client.completions.create(model=MODEL, prompt=p, max_tokens=32,
                                     extra_body=draft).choices[0].text for p in PROMPTS[1:3]]
    seeded = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24,
                                       temperature=0.8, seed=9, extra_body=draft)
    out.append(seeded.choices[0].text)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=24,
        stream=True, extra_body=draft)
    out.append("|".join(chunk.choices[0].delta.content or "" for chunk in stream
                        if chunk.choices))
    return out


def spec_counters(url: str) -> dict[str, float]:
    """``{"ngram_proposed": ..., "draft_accepted": ...}`` from a node's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(r'^mlxcel:spec_(proposed|accepted)_total\{method="(\w+)"\} (\S+)$', text,
                       re.MULTILINE)
    return {f"{method}_{name}": float(value) for name, method, value in found}


def router_stats_counters(url: str, want: dict[str, float], timeout_s: float = 20) -> dict:
    """The decode node's totals in /router/stats, once its telemetry has caught up."""
    deadline, shown = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        node = httpx.get(f"{url}/router/stats", timeout=10).json()["nodes"]["decode"][0]
        per_method = (node["telemetry"] or {}).get("speculative", {})
        shown = {f"{m}_{k}": float(v[k]) for m, v in per_method.items()
                 for k in ("proposed", "accepted")}
        if shown == want:
            return per_method
        time.sleep(0.2)
    raise AssertionError(f"/router/stats shows {shown}, the decode node {want}")


def test_hybrid_and_cluster_speculate_alike(tiny_model_path, tmp_path: Path):
    toml = tmp_path / "spec.toml"
    draft = noisy_copy(tiny_model_path, tmp_path / "draft")
    # Every request through a prefill node and a KV handoff.
    toml.write_text(SPEC_TOML + f'draft_model = "{draft}"\n'
                    "[prefix_cache]\nlocal_prefill_tokens = 0\n")
    args = ["--model", str(tiny_model_path), "--served-model-name", MODEL, "--no-warmup",
            "--distributed-config", str(toml)]
    hybrid = start_node("hybrid", tmp_path, args)
    try:
        hybrid.wait_healthy(STARTUP_TIMEOUT_S)
        expected, hybrid_counts = replies(hybrid.url), spec_counters(hybrid.url)
    finally:
        hybrid.stop()
    cluster = LocalCluster(workdir=tmp_path, model=str(tiny_model_path), common_args=args[2:])
    cluster.start(STARTUP_TIMEOUT_S)
    try:
        routed = replies(cluster.router.url)
        decode_counts = spec_counters(cluster.pool("decode")[0].url)
        shown = router_stats_counters(cluster.router.url, decode_counts)
    finally:
        cluster.stop()
    assert routed == expected
    for method in ("ngram", "draft"):  # speculation did take tokens, by both methods
        assert hybrid_counts[f"{method}_accepted"] > 0, hybrid_counts
    assert decode_counts == hybrid_counts
    assert 0 < shown["draft"]["acceptance_rate"] < 1
