"""A decode node kept off its CPU sets a handoff's pace, not the link: its ack says so, and
the prefill node takes that pace as a floor on the link rather than as a slow link, on
which ``codec = "auto"`` would compress and add decoding to the starved side
(docs/bulk-lanes.md#who-set-the-pace).

Real nodes on loopback, the fake engine with a 16 KiB-a-token cache, prompts of 1000
tokens (16 MB): the decode node reads KV at ``--ingest-nice 19`` on one core that a busy
process shares, so its readers wait on the run queue for most of each handoff.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.link import generate_secret_file, load_cluster_secret
from mlxcel_plugin.local_cluster import LOOPBACK, free_port, start_node
from mlxcel_plugin.testing.fake_engine import expected_tokens
from mlxcel_plugin.testing.link_driver import LinkDriver
from mlxcel_plugin.transfer.pacing import RECEIVER, RECEIVER_PACED_SHARE
from mlxcel_plugin.transfer.selector import SelectorTuning
from tests.integration.test_receive_settings import prometheus_value

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="pins processes to a core; run-queue waits are Linux's")

PROMPT = tuple(100 + i % 800 for i in range(1000))
HOG = "import sys; print('ready', flush=True)\nwhile True: pass"
KNOBS = {"num_layers": 8, "kv_heads": 4, "head_dim": 64}


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
        return json.loads(response.read())


def test_a_starved_decode_node_paces_its_handoffs_and_the_selector_sends_raw_bytes(tmp_path):
    (tmp_path / "fake_engine.json").write_text(json.dumps(KNOBS))
    secret_path = tmp_path / "cluster.secret"
    generate_secret_file(secret_path)
    toml = tmp_path / "prefill.toml"
    toml.write_text('[transfer]\nstrategy = "full"\ncodec = "auto"\n')
    common = ["--engine", "fake", "--model", str(tmp_path), "--no-warmup",
              "--cluster-secret-file", str(secret_path)]
    core = max(os.sched_getaffinity(0))
    binds = {role: f"{LOOPBACK}:{free_port()}" for role in ("prefill", "decode")}
    started, hog = [], None
    try:
        decode = start_node("decode", tmp_path, [*common, "--ingest-nice", "19"],
                            serving_bind=binds["decode"], cpu_affinity={core})
        started.append(decode)
        prefill = start_node("prefill", tmp_path, [*common, "--distributed-config", str(toml)],
                             serving_bind=binds["prefill"])
        started.append(prefill)
        for node in started:
            node.wait_healthy(60)
        hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
        os.sched_setaffinity(hog.pid, {core})
        assert hog.stdout.readline().strip() == "ready"

        async def two_handoffs() -> list:
            secret = load_cluster_secret(str(secret_path), {})
            async with LinkDriver(secret, binds["prefill"], binds["decode"]) as driver:
                return [await driver.generate(f"paced-{i}", PROMPT, 3, timeout_s=120)
                        for i in range(2)]

        outcomes = asyncio.run(two_handoffs())
        state = health(prefill.url)["transfer"]
        with urllib.request.urlopen(f"{decode.url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        for node in reversed(started):
            node.stop()
    for outcome in outcomes:
        assert outcome.tokens == expected_tokens(GenerationRequest("x", PROMPT, 3)), outcome
    (estimate,) = state["bandwidth_bytes_per_s"].values()
    assert estimate["paced_by"] == RECEIVER, state
    second = state["last_choice"]  # planned on the first handoff's floor
    assert second["paced_by"] == RECEIVER and second["codec"] == "none", second
    assert state["last_reader_busy_share"] >= RECEIVER_PACED_SHARE
    # The decode node's own account of both: its readers busy through them.
    assert prometheus_value(metrics, "mlxcel:kv_ingest_reader_busy_share_count") == 2
    assert prometheus_value(metrics, 'mlxcel:kv_ingest_reader_busy_share_bucket{le="0.6"}') == 0
    # A floor only rises (the second handoff's pace moved the estimate up or left it), and
    # one below the selector's prior leaves the prior: the link is at least that fast.
    prior = SelectorTuning().prior_bytes_per_s
    assert prior <= second["bandwidth_bytes_per_s"] <= max(estimate["bytes_per_s"], prior)
    assert second["bandwidth_source"] == (
        "prior" if second["bandwidth_bytes_per_s"] == prior else "measured")
