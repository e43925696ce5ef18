"""``[speculative] method = "ngram"`` on a hybrid node and on a prefill + decode cluster:
the same replies through the openai SDK, and the same speculation choices.

The adaptive rule is a pure function of the tokens, so the decode node proposes,
accepts and rejects exactly what the hybrid node does; equal ``mlxcel:spec_*``
counters show it, beside equal replies (greedy and seeded, streamed and not, and a
request that turns speculation off with the extra body field).
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.local_cluster import LocalCluster, start_node

STARTUP_TIMEOUT_S = 180
MODEL = "tiny"
REPEATED = " ".join(["def add(a, b):\n    return a + b\n"] * 6)
PROMPTS = [REPEATED, "the fox ran over the hill and " * 8, "List the numbers: 1, 2, 3,",
           "Edit the function:\n" + REPEATED]
SPEC_TOML = '[speculative]\nmethod = "ngram"\n'
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
    return out


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(r'^mlxcel:spec_(proposed|accepted)_total\{method="ngram"\} (\S+)$', text,
                       re.MULTILINE)
    return {name: float(value) for name, value in found}


def test_hybrid_and_cluster_speculate_alike(tiny_model_path, tmp_path: Path):
    toml = tmp_path / "spec.toml"
    # Every request through a prefill node and a KV handoff.
    toml.write_text(SPEC_TOML + "[prefix_cache]\nlocal_prefill_tokens = 0\n")
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
    finally:
        cluster.stop()
    assert routed == expected
    assert hybrid_counts["accepted"] > 0, hybrid_counts  # speculation did take tokens
    assert decode_counts == hybrid_counts
