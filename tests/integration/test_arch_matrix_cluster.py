"""Real router + prefill + decode processes for one MLA, one SSM and one hybrid architecture.

The in-process matrix (``test_arch_matrix``) covers every architecture and
strategy at the engine level; this runs the nodes as users do (``--model
PATH``) and compares every response body with a hybrid node's, byte for byte
after normalizing ``id`` and ``created``: completions and chat, greedy and
seeded, streamed and not, with a prompt longer than any sliding window.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from engines.tiny_models import ensure_arch_model
from mlxcel_plugin.local_cluster import LocalCluster, start_node
from tests.conftest import model_cache_root

STARTUP_TIMEOUT_S = 180
MODEL = "tiny"
LONG = " ".join(["the fox ran over the hill and"] * 8)  # ~60 tokens: past the 32-token windows
MESSAGES = [{"role": "user", "content": LONG}]
CASES = [
    ("/v1/completions", {"prompt": LONG, "max_tokens": 8}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 8, "temperature": 0.8, "seed": 3,
                         "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.8,
                              "seed": 7, "stream": True}),
]
# (architecture, transfer strategy): MLA, pure SSM, attention + SSM.
RUNS = [("deepseek_v3", "layer-parallel"), ("mamba2", "streamed"), ("qwen3_next", "full")]
pytestmark = pytest.mark.timeout(900)


def normalize(body: str) -> str:
    def strip(text: str) -> str:
        obj = json.loads(text)
        if isinstance(obj, dict):
            obj.pop("id", None)
            obj.pop("created", None)
        return json.dumps(obj)

    if not body.startswith("data: "):
        return strip(body)
    return "\n".join("data: " + strip(line[6:]) if line.startswith("data: {") else line
                     for line in body.split("\n"))


def bodies(url: str, cases: list[tuple[str, dict]] = CASES) -> list[str]:
    out = []
    with httpx.Client(timeout=300) as http:
        for path, body in cases:
            response = http.post(f"{url}{path}", json={"model": MODEL, **body})
            assert response.status_code == 200, response.text
            out.append(normalize(response.text))
    return out


def handoff_count(url: str, want: int = len(CASES), timeout_s: float = 30.0) -> float:
    """Handoffs the prefill node has had acked, once ``want`` are (an ack may trail the reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("mlxcel:handoff_bytes_count ")]
        count = float(lines[0].split()[-1]) if lines else 0.0
        if count >= want or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


@pytest.mark.parametrize(("arch", "strategy"), RUNS, ids=[arch for arch, _ in RUNS])
def test_cluster_answers_what_a_hybrid_node_does(arch: str, strategy: str, tmp_path: Path):
    model = str(ensure_arch_model(arch, root=model_cache_root()))
    args = ["--model", model, "--served-model-name", MODEL, "--no-warmup"]
    toml = tmp_path / "cluster.toml"
    # Every request through a prefill node and a handoff (no decode-local prefill).
    toml.write_text(f'[transfer]\nstrategy = "{strategy}"\nparallelism = 2\n'
                    "[prefix_cache]\nlocal_prefill_tokens = 0\n")
    cluster = LocalCluster(workdir=tmp_path, model=model, common_args=[
        "--served-model-name", MODEL, "--no-warmup", "--distributed-config", str(toml)])
    # The reference node and the cluster start side by side: one wait for start-up, not two.
    hybrid = start_node("hybrid", tmp_path, args)
    try:
        cluster.launch()
        hybrid.wait_healthy(STARTUP_TIMEOUT_S)
        cluster.wait_healthy(STARTUP_TIMEOUT_S)
        expected = bodies(hybrid.url)
        routed = bodies(cluster.router.url)
        handoffs = handoff_count(cluster.pool("prefill")[0].url)
    finally:
        hybrid.stop()
        cluster.stop()
    for case, want, got in zip(CASES, expected, routed, strict=True):
        assert got == want, case
    assert handoffs == len(CASES)
