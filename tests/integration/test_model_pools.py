"""One router over two models (``[models.NAME]`` pools), each with its own prefill and decode
node, driven with the ``openai`` SDK: each request is served by its model's pool, with the
text a hybrid node of that model gives; an unknown model gets 404 ``model_not_found``;
``/v1/models`` and ``/metrics`` cover both models.

The two tiny checkpoints have different random weights (and a config key apart, so
their digests differ: a node of the other model is refused by the link verdict).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LOOPBACK, NodeProcess, free_port, start_node

STARTUP_TIMEOUT_S = 300
MESSAGES = [{"role": "user", "content": "Write a short story about a fox."}]
NAMES = ("tiny-a", "tiny-b")
pytestmark = pytest.mark.timeout(900)


def second_checkpoint(root: Path) -> str:
    from engines.model_store import write_tiny_checkpoint

    out = write_tiny_checkpoint(root / "tiny-b", seed=7)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "mlxcel_test_variant": "b"}))
    return str(out)


def engine_node(role: str, workdir: Path, model: str, secret: Path) -> NodeProcess:
    args = ["--model", model, "--cluster-secret-file", str(secret), "--no-warmup"]
    return start_node(role, workdir, args, serving_bind=f"{LOOPBACK}:{free_port()}",
                      name=f"{role}-{Path(model).name}")  # fmt: skip


def pools_toml(models: dict[str, str], nodes: dict[str, list[NodeProcess]]) -> str:
    lines = []
    for name, model in models.items():
        prefill, decode = (n.serving_bind for n in nodes[name])
        lines += [f"[models.{name}]", f'model = "{model}"',
                  f'prefill_peers = ["{prefill}"]', f'decode_peers = ["{decode}"]', ""]
    return "\n".join(lines)


def greedy_text(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16,
                                           temperature=0)  # fmt: skip
    return reply.choices[0].message.content


def test_router_routes_each_model_to_its_pool(tiny_model_path: Path, tmp_path: Path) -> None:
    models = {"tiny-a": str(tiny_model_path), "tiny-b": second_checkpoint(tmp_path)}
    secret = tmp_path / "cluster.secret"
    generate_secret_file(secret)
    started: list[NodeProcess] = []
    try:
        hybrids = {name: start_node("hybrid", tmp_path, ["--model", model, "--no-warmup",
                                                         "--served-model-name", name],
                                    name=f"hybrid-{name}")  # fmt: skip
                   for name, model in models.items()}
        started += hybrids.values()
        nodes = {name: [engine_node(role, tmp_path, model, secret)
                        for role in ("prefill", "decode")]
                 for name, model in models.items()}  # fmt: skip
        started += [node for pair in nodes.values() for node in pair]
        (tmp_path / "router.toml").write_text(pools_toml(models, nodes))
        router = start_node("router", tmp_path, [
            "--model", models["tiny-a"], "--cluster-secret-file", str(secret),
            "--distributed-config", str(tmp_path / "router.toml")])  # fmt: skip
        started.append(router)
        for node in started:
            node.wait_healthy(STARTUP_TIMEOUT_S)
        expected = {name: greedy_text(hybrids[name].url, name) for name in NAMES}
        assert expected["tiny-a"] != expected["tiny-b"]  # the weights differ
        for name in NAMES:
            assert greedy_text(router.url, name) == expected[name], name
        with pytest.raises(openai.NotFoundError) as refused:
            greedy_text(router.url, "no-such-model")
        assert refused.value.code == "model_not_found"
        listed = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"]
        assert [card["id"] for card in listed] == list(NAMES)
        assert all(card["max_model_len"] and card["owned_by"] for card in listed)
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        for name in NAMES:
            assert f'mlxcel:generation_tokens_total{{model_name="{name}"}}' in metrics
    finally:
        for node in reversed(started):
            node.stop()
