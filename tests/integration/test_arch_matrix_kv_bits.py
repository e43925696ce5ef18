"""[engine] kv_bits = 8 through real router + prefill + decode processes: the hybrid's bytes.

The prefill node quantizes each prompt's K/V as its prefill ends and ships
the packed words, scales and biases as they are; the decode node decodes
from them (engines/kv_quant.py). Every response body must equal a hybrid
node's with the same ``kv_bits``, and differ from a full-precision run's
somewhere (or kv_bits would not be in effect).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engines.tiny_models import ensure_arch_model
from mlxcel_plugin.local_cluster import LocalCluster, start_node
from tests.conftest import model_cache_root
from tests.integration.test_arch_matrix_cluster import (
    CASES,
    MODEL,
    STARTUP_TIMEOUT_S,
    bodies,
    handoff_count,
)

KV_BITS = "[engine]\nkv_bits = 8\nkv_group_size = 32\n"
pytestmark = pytest.mark.timeout(900)


def hybrid_bodies(tmp_path: Path, model: str, toml: Path) -> list[str]:
    node = start_node("hybrid", tmp_path, ["--model", model, "--served-model-name", MODEL,
                                           "--no-warmup", "--distributed-config", str(toml)])
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        return bodies(node.url)
    finally:
        node.stop()


def test_kv_bits_cluster_answers_what_a_hybrid_node_does(tmp_path: Path):
    # head_dim 32: mx.quantize needs groups of 32 along it.
    model = str(ensure_arch_model("llama", root=model_cache_root(), head_dim=32))
    quantized, plain = tmp_path / "kv8.toml", tmp_path / "plain.toml"
    quantized.write_text(KV_BITS)
    plain.write_text("")
    expected = hybrid_bodies(tmp_path, model, quantized)
    assert expected != hybrid_bodies(tmp_path, model, plain)  # kv_bits changes the numbers
    toml = tmp_path / "cluster.toml"
    # Every request through a prefill node and a handoff (no decode-local prefill).
    toml.write_text(KV_BITS + '[transfer]\nstrategy = "streamed"\n'
                    "[prefix_cache]\nlocal_prefill_tokens = 0\n")
    cluster = LocalCluster(workdir=tmp_path, model=model, common_args=[
        "--served-model-name", MODEL, "--no-warmup", "--distributed-config", str(toml)])
    cluster.start(STARTUP_TIMEOUT_S)
    try:
        routed = bodies(cluster.router.url)
        prefill_url = cluster.pool("prefill")[0].url
        handoffs = handoff_count(prefill_url)
        metrics = httpx.get(f"{prefill_url}/metrics", timeout=10).text
    finally:
        cluster.stop()
    for case, want, got in zip(CASES, expected, routed, strict=True):
        assert got == want, case
    assert handoffs == len(CASES), metrics[-2000:]
