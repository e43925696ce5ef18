"""``examples/litellm/models.yaml`` runs as shipped: the real LiteLLM proxy routes two
models to one several-model router and a LoRA adapter to a hybrid node.

The router and the hybrid are started where the file points (8090, 8091). The
router's pools run the ``fake`` engine on the tiny checkpoint and a copy of it
(a config key apart: another model digest); the hybrid runs MLX with a seeded
adapter, named as the file names it.
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


def start_router(workdir: Path, models: dict[str, Path], port: int) -> list[NodeProcess]:
    secret = workdir / "cluster.secret"
    generate_secret_file(secret)
    common = ["--cluster-secret-file", str(secret), "--engine", "fake", "--no-warmup"]
    nodes, toml = [], []
    for name, model in models.items():
        pair = [start_node(role, workdir, [*common, "--model", str(model)], name=f"{role}-{name}",
                           serving_bind=f"{LOOPBACK}:{free_port()}")
                for role in ("prefill", "decode")]  # fmt: skip
        nodes += pair
        toml += [f"[models.{name}]", f'model = "{model}"',
                 f'prefill_peers = ["{pair[0].serving_bind}"]',
                 f'decode_peers = ["{pair[1].serving_bind}"]']  # fmt: skip
    (workdir / "router.toml").write_text("\n".join(toml) + "\n")
    nodes.append(start_node("router", workdir, [*common, "--model", str(models["tiny"]),
                                                "--distributed-config",
                                                str(workdir / "router.toml")], port=port))
    return nodes


def test_the_proxy_routes_two_models_and_an_adapter(tiny_model_path: Path,
                                                    tmp_path: Path) -> None:
    from tests.integration.test_adapters_hybrid import write_adapters

    params = entries()
    ports = {name: port_of(p["api_base"]) for name, p in params.items()}
    busy = sorted({p for p in ports.values() if not port_free(f"{LOOPBACK}:{p}")})
    if busy:
        pytest.skip(f"the example's ports are taken on this machine: {busy}")
    models = {"smollm2": tiny_model_path, "tiny": other_model(tiny_model_path, tmp_path / "b")}
    adapter = write_adapters(tiny_model_path, tmp_path)[0]
    nodes = start_router(tmp_path, models, ports["smollm2"])
    proxy = None
    try:
        nodes.append(start_node("hybrid", tmp_path, [
            "--model", str(tiny_model_path), "--served-model-name", "smollm2", "--no-warmup",
            "--adapter", f"sql={adapter}@smollm2"], port=ports["sql"]))  # fmt: skip
        for node in nodes:
            node.wait_healthy(300)
        port = free_port()
        argv = [str(Path(sys.executable).parent / "litellm"), "--config", str(CONFIG),
                "--host", LOOPBACK, "--port", str(port)]  # fmt: skip
        with open(tmp_path / "proxy.log", "ab") as log:
            proxy = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                     env={**os.environ, **OFFLINE_ENV})  # fmt: skip
        url = f"http://{LOOPBACK}:{port}"
        wait_alive(url, proxy, PROXY_START_TIMEOUT_S)
        key = yaml.safe_load(CONFIG.read_text())["general_settings"]["master_key"]
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                           timeout=120) as client:  # fmt: skip
            for name in params:
                reply = client.chat.completions.create(
                    model=name, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
                assert reply.choices[0].finish_reason in ("stop", "length"), name
                assert reply.usage.completion_tokens >= 1
    finally:
        if proxy is not None:
            stop(proxy)
        for node in reversed(nodes):
            node.stop()
