"""KV that converts across a handoff, through real router + prefill + decode processes.

* A float32 prefill node and a float16 (or bfloat16) decode node of the same
  model (same ``config.json``; the weights cast, as a Mac would keep them): the
  prefill node casts its K/V to the decode node's dtype before sending, every
  request is handed off and completes, and ``/router/stats`` shows the pair
  with its conversion. The text may differ from a single node's (a dtype cast
  is not byte-identical): ``loadtests/bench_kv_conversion.py`` measures how often.
* A plain-KV prefill node and a ``kv_bits = 8`` decode node: the decode node
  quantizes the K/V on arrival, and every reply is byte for byte what a
  ``kv_bits = 8`` hybrid node answers (and not what a plain one does), so the
  decode node decoded from quantized K/V.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from engines.model_store import ensure_default_model
from engines.tiny_models import ensure_arch_model
from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LOOPBACK, NodeProcess, free_port, start_node
from mlxcel_plugin.testing.membership_harness import node_entry, router_stats, wait_until
from tests.conftest import model_cache_root
from tests.integration.test_arch_matrix_cluster import (
    CASES,
    MODEL,
    STARTUP_TIMEOUT_S,
    bodies,
    handoff_count,
)
from tests.integration.test_arch_matrix_kv_bits import KV_BITS, hybrid_bodies

pytestmark = pytest.mark.timeout(900)
# Every request through a prefill node and a handoff (no decode-local prefill). Whole-chunk
# reuse: no node runs the start-up reuse probe, which is not what these tests check and which
# costs minutes on a float16 SmolLM2 on a CPU (its own tests: tests/engines/prefix/).
ROUTED = ('[transfer]\nstrategy = "streamed"\n'
          '[prefix_cache]\nlocal_prefill_tokens = 0\ngranularity = "chunk"\n')
SLOW_STARTUP_S = 600
_MX = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def dtype_copy(model: Path, out: Path, dtype: str) -> Path:
    """``model`` with its float weights in ``dtype`` (config and tokenizer as they are)."""
    if out.exists():
        return out
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(model, staging)
    weights = mx.load(str(model / "model.safetensors"))
    cast = {name: w.astype(_MX[dtype]) if mx.issubdtype(w.dtype, mx.floating) else w
            for name, w in sorted(weights.items())}
    mx.save_safetensors(str(staging / "model.safetensors"), cast, metadata={"format": "mlx"})
    staging.rename(out)
    return out


def tiny_model() -> Path:
    return ensure_arch_model("llama", root=model_cache_root(), head_dim=32)  # kv_bits: 32s


class Pair:
    """A prefill node and a decode node (each its own checkpoint and TOML) behind a router."""

    def __init__(self, workdir: Path, startup_s: float = STARTUP_TIMEOUT_S):
        self.workdir, self.nodes, self.startup_s = workdir, [], startup_s
        workdir.mkdir(parents=True, exist_ok=True)
        self.secret = workdir / "cluster.secret"
        generate_secret_file(self.secret)

    def args(self, model: Path, toml: str, name: str) -> list[str]:
        config = self.workdir / f"{name}.toml"
        config.write_text(toml)
        return ["--cluster-secret-file", str(self.secret), "--served-model-name", MODEL,
                "--no-warmup", "--distributed-config", str(config), "--model", str(model)]

    def start(self, prefill_model: Path, decode_model: Path, decode_toml: str = ROUTED
              ) -> tuple[NodeProcess, NodeProcess, NodeProcess]:
        binds = [f"{LOOPBACK}:{free_port()}" for _ in range(2)]
        prefill = self._node("prefill", self.args(prefill_model, ROUTED, "prefill"), binds[0])
        decode = self._node("decode", self.args(decode_model, decode_toml, "decode"), binds[1])
        router = self._node("router", [*self.args(prefill_model, ROUTED, "router"),
                                       "--prefill-peers", binds[0], "--decode-peers", binds[1]])
        for node in self.nodes:
            node.wait_healthy(self.startup_s)
        wait_until(lambda: all(e["health"] == "healthy" and e["kv"] for role in
                               router_stats(router.url)["nodes"].values() for e in role), 60)
        return prefill, decode, router

    def _node(self, role: str, args: list[str], bind: str | None = None) -> NodeProcess:
        env = {"MLXCEL_ROUTER_STATS_VERBOSE": "1"}  # addresses in /router/stats
        node = start_node(role, self.workdir, args, serving_bind=bind, name=role, env=env)
        self.nodes.append(node)
        return node

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.terminate()
        for node in reversed(self.nodes):
            node.wait_stopped()


def _metric(url: str, name: str) -> float:
    lines = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
             if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def checkpoint(dtype: str) -> Path:
    model = tiny_model()
    return model if dtype == "float32" else dtype_copy(
        model, model_cache_root() / f"{model.name}-{dtype}", dtype)


# (prefill dtype, decode dtype): the prefill node casts down; a float32 decode node widens.
DTYPE_PAIRS = [("float32", "float16"), ("float32", "bfloat16"), ("float16", "float32")]


@pytest.mark.parametrize(("sender", "receiver"), DTYPE_PAIRS,
                         ids=[f"{a}-{b}" for a, b in DTYPE_PAIRS])
def test_a_handoff_between_dtypes_converts_and_completes(tmp_path: Path, sender: str,
                                                         receiver: str):
    pair = Pair(tmp_path)
    try:
        prefill, decode, router = pair.start(checkpoint(sender), checkpoint(receiver))
        entry = node_entry(router_stats(router.url), "decode", decode.serving_bind)
        routed = bodies(router.url)  # each a 200
        handoffs = handoff_count(prefill.url)
        sent_bytes = _metric(prefill.url, "mlxcel:handoff_bytes_sum")
    finally:
        pair.stop()
    assert entry["pairs"] and entry["refused"] == [], entry
    assert entry["converts"] == [{"with": entry["pairs"][0], "converts": f"{sender}->{receiver}"}]
    assert handoffs == len(CASES)
    streamed = [body for body, (_, case) in zip(routed, CASES, strict=True) if case.get("stream")]
    assert streamed and all(body.rstrip().endswith("data: [DONE]") for body in streamed)
    log = prefill.log_path.read_text()
    assert f"convert: {sender}->{receiver}" in log, log[-2000:]
    print(f"\n{sender} -> {receiver}: {handoffs:.0f} handoffs, {sent_bytes:.0f} bytes sent")


# A completion and a stream: float16 steps on a CPU are slow (MLX's own kernels), and the
# chat cases cross the same conversion (the tiny models above take all four).
SMOLLM2_CASES = CASES[:2]


@pytest.mark.smollm2
def test_smollm2_float32_prefill_to_a_float16_decode_node(tmp_path: Path):
    model = ensure_default_model(model_cache_root())
    narrow = dtype_copy(model, model_cache_root() / f"{model.name}-float16", "float16")
    pair = Pair(tmp_path, startup_s=SLOW_STARTUP_S)  # float16 on a CPU: a slow start
    try:
        prefill, decode, router = pair.start(model, narrow)
        entry = node_entry(router_stats(router.url), "decode", decode.serving_bind)
        routed = bodies(router.url, SMOLLM2_CASES)
        handoffs = handoff_count(prefill.url, len(SMOLLM2_CASES))
    finally:
        pair.stop()
    assert entry["converts"] == [{"with": entry["pairs"][0], "converts": "float32->float16"}]
    assert handoffs == len(SMOLLM2_CASES) and len(routed) == len(SMOLLM2_CASES)
    assert routed[1].rstrip().endswith("data: [DONE]")


def test_a_plain_prefill_node_hands_off_to_a_kv_bits_decode_node(tmp_path: Path):
    model = tiny_model()
    quantized, plain = tmp_path / "kv8.toml", tmp_path / "plain.toml"
    quantized.write_text(KV_BITS)
    plain.write_text("")
    expected = hybrid_bodies(tmp_path, str(model), quantized)
    assert expected != hybrid_bodies(tmp_path, str(model), plain)  # kv_bits changes the text
    pair = Pair(tmp_path / "pair")
    try:
        prefill, decode, router = pair.start(model, model, KV_BITS + ROUTED)
        entry = node_entry(router_stats(router.url), "decode", decode.serving_bind)
        routed = bodies(router.url)
        handoffs = handoff_count(prefill.url)
    finally:
        pair.stop()
    assert entry["converts"] == [{"with": entry["pairs"][0],
                                  "converts": "quantize kv_bits=8/32"}], entry
    assert handoffs == len(CASES)
    for case, want, got in zip(CASES, expected, routed, strict=True):
        assert got == want, case  # decoded from K/V quantized on arrival, as the hybrid's
