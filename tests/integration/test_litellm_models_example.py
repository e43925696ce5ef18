"""``examples/litellm/models.yaml`` runs as shipped: the real LiteLLM proxy routes two
models and a LoRA adapter to one several-model router.

The router is started where the file points (8090). Its ``smollm2`` pool runs MLX on the
tiny checkpoint, its nodes holding a seeded adapter named as the file names it (its greedy
text through the proxy differs from the base's); its ``tiny`` pool runs the ``fake`` engine
on a copy of the checkpoint (a config key apart: another model digest).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import yaml

from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LOOPBACK, NodeProcess, free_port, start_node
from tests.integration.test_litellm_example import PROXY_START_TIMEOUT_S, port_free
from tests.integration.test_litellm_provider import OFFLINE_ENV, stop, wait_alive

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "litellm" / "models.yaml"
MESSAGES = [{"role": "user", "content": "Write a short story about a fox."}]
pytestmark = pytest.mark.timeout(600)


def entries() -> dict[str, dict]:
    shipped = yaml.safe_load(CONFIG.read_text())
    return {e["model_name"]: e["litellm_params"] for e in shipped["model_list"]}


def port_of(api_base: str) -> int:
    return int(api_base.rsplit(":", 1)[1].split("/")[0])


def other_model(tiny: Path, out: Path) -> Path:
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "mlxcel_test_variant": "b"}))
    return out


def start_router(workdir: Path, models: dict[str, Path], port: int,
                 adapter: Path) -> list[NodeProcess]:  # fmt: skip
    """The router over one pool per model: MLX with the adapter for smollm2, fake for tiny."""
    secret = workdir / "cluster.secret"
    generate_secret_file(secret)
    common = ["--cluster-secret-file", str(secret), "--no-warmup"]
    engine = {"smollm2": ["--adapter", f"sql={adapter}"], "tiny": ["--engine", "fake"]}
    nodes, toml = [], []
    for name, model in models.items():
        args = [*common, *engine[name], "--model", str(model)]
        pair = [start_node(role, workdir, args, name=f"{role}-{name}",
                           serving_bind=f"{LOOPBACK}:{free_port()}")
                for role in ("prefill", "decode")]  # fmt: skip
        nodes += pair
        toml += [f"[models.{name}]", f'model = "{model}"',
                 f'prefill_peers = ["{pair[0].serving_bind}"]',
                 f'decode_peers = ["{pair[1].serving_bind}"]']  # fmt: skip
    pools = workdir / "router.toml"
    pools.write_text("\n".join(toml) + "\n")
    router = [*common, "--model", str(models["tiny"]), "--distributed-config", str(pools)]
    nodes.append(start_node("router", workdir, router, port=port))
    return nodes


def start_proxy(workdir: Path) -> tuple[subprocess.Popen, str]:
    """The real LiteLLM proxy on the shipped file, unchanged: (process, its URL)."""
    port = free_port()
    argv = [str(Path(sys.executable).parent / "litellm"), "--config", str(CONFIG),
            "--host", LOOPBACK, "--port", str(port)]  # fmt: skip
    with open(workdir / "proxy.log", "ab") as log:
        proxy = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                                 env={**os.environ, **OFFLINE_ENV})  # fmt: skip
    url = f"http://{LOOPBACK}:{port}"
    wait_alive(url, proxy, PROXY_START_TIMEOUT_S)
    return proxy, url


def greedy_replies(url: str, names: list[str]) -> dict[str, str]:
    key = yaml.safe_load(CONFIG.read_text())["general_settings"]["master_key"]
    texts = {}
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                       timeout=120) as client:  # fmt: skip
        for name in names:
            reply = client.chat.completions.create(model=name, max_tokens=16, temperature=0,
                                                   messages=MESSAGES)  # fmt: skip
            assert reply.choices[0].finish_reason in ("stop", "length"), name
            assert reply.usage.completion_tokens >= 1, name
            texts[name] = reply.choices[0].message.content
    return texts


def test_the_proxy_routes_two_models_and_an_adapter(tiny_model_path: Path, tmp_path: Path) -> None:
    from tests.integration.test_adapters_hybrid import write_adapters
    from tests.integration.test_model_pools import wait_for_card

    params = entries()
    ports = {port_of(p["api_base"]) for p in params.values()}
    assert len(ports) == 1  # every entry names the one router
    (port,) = ports
    if not port_free(f"{LOOPBACK}:{port}"):
        pytest.skip(f"the example's port is taken on this machine: {port}")
    models = {"smollm2": tiny_model_path, "tiny": other_model(tiny_model_path, tmp_path / "b")}
    adapter = write_adapters(tiny_model_path, tmp_path)[0]
    nodes = start_router(tmp_path, models, port, adapter)
    proxy = None
    try:
        for node in nodes:
            node.wait_healthy(300)
        assert wait_for_card(nodes[-1].url, "sql")["parent"] == "smollm2"
        proxy, url = start_proxy(tmp_path)
        texts = greedy_replies(url, list(params))
        assert texts["sql"] != texts["smollm2"]  # the adapter, applied through the cluster
    finally:
        if proxy is not None:
            stop(proxy)
        for node in reversed(nodes):
            node.stop()
