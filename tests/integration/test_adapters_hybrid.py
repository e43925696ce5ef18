"""A hybrid node serving two seeded LoRA adapters over the tiny checkpoint (``--adapter``),
driven with the ``openai`` SDK: a request naming an adapter gets the text a hybrid node
on the adapter fused into the weights with mlx-lm gives (greedy), different from the
base's; base and adapter requests in flight together (one decode batch) each get the text
they get alone; ``/v1/models`` lists the adapters with their base; an unknown name is 404.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.local_cluster import NodeProcess, start_node

STARTUP_TIMEOUT_S = 300
BASE = "tiny"
PROMPTS = ["Write a short story about a fox.", "List three colours.", "Say hello twice."]
pytestmark = pytest.mark.timeout(900)


def write_adapters(tiny: Path, root: Path) -> list[Path]:
    from mlx_lm.utils import load

    from engines.lora.random_adapter import write_random_adapter

    model, _ = load(str(tiny))
    return [write_random_adapter(model, root / f"a{seed}", seed=seed) for seed in range(2)]


def fused_checkpoint(tiny: Path, adapter: Path, out: Path) -> str:
    """The tiny checkpoint with ``adapter`` fused into its weights by mlx-lm."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    model = load_adapters(load(str(tiny))[0], str(adapter))
    fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused))
    shutil.copytree(tiny, out)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return str(out)


def text(url: str, model: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": prompt}])
    return reply.choices[0].message.content


def test_adapters_on_a_hybrid_node(tiny_model_path: Path, tmp_path: Path) -> None:
    adapters = write_adapters(tiny_model_path, tmp_path)
    fused = fused_checkpoint(tiny_model_path, adapters[0], tmp_path / "fused-a0")
    args = ["--model", str(tiny_model_path), "--served-model-name", BASE, "--no-warmup"]
    started: list[NodeProcess] = []
    try:
        node = start_node("hybrid", tmp_path, [*args, "--adapter", f"a0={adapters[0]}",
                                               "--adapter", f"a1={adapters[1]}@{BASE}"])
        reference = start_node("hybrid", tmp_path, ["--model", fused, "--no-warmup",
                                                    "--served-model-name", "a0"])
        started += [node, reference]
        for process in started:
            process.wait_healthy(STARTUP_TIMEOUT_S)
        prompt = PROMPTS[0]
        assert text(node.url, "a0", prompt) == text(reference.url, "a0", prompt)
        assert text(node.url, "a0", prompt) != text(node.url, BASE, prompt)
        cases = [(model, p) for p in PROMPTS for model in (BASE, "a0", "a1")]
        alone = [text(node.url, model, p) for model, p in cases]
        with ThreadPoolExecutor(len(cases)) as pool:  # in flight together: one batch
            together = list(pool.map(lambda case: text(node.url, *case), cases))
        assert together == alone
        client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="none", max_retries=0)
        cards = {card.id: card for card in client.models.list().data}
        assert set(cards) == {BASE, "a0", "a1"}
        assert cards["a1"].model_extra["parent"] == BASE
        with pytest.raises(openai.NotFoundError):
            text(node.url, "a2", prompt)
    finally:
        for process in started:
            process.stop()


def test_load_and_unload_at_run_time(tiny_model_path: Path, tmp_path: Path) -> None:
    adapters = write_adapters(tiny_model_path, tmp_path)
    node = start_node("hybrid", tmp_path, ["--model", str(tiny_model_path), "--no-warmup",
                                           "--served-model-name", BASE, "--enable-lora",
                                           "--api-key", "k"])  # fmt: skip
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        keyed = httpx.Client(base_url=node.url, timeout=60,
                             headers={"Authorization": "Bearer k"})  # fmt: skip
        body = {"lora_name": "a0", "lora_path": str(adapters[0])}
        assert httpx.post(f"{node.url}/v1/load_lora_adapter", json=body).status_code == 401
        bad = keyed.post("/v1/load_lora_adapter", json={**body, "lora_path": "/nowhere"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        loaded = keyed.post("/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200 and loaded.json()["digest"]
        client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="k", max_retries=0)
        ask = {"messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0}
        adapted = client.chat.completions.create(model="a0", max_tokens=16, **ask)
        base = client.chat.completions.create(model=BASE, max_tokens=16, **ask)
        assert adapted.choices[0].message.content != base.choices[0].message.content
        # A long stream on a0 while it is unloaded: it runs to its end on a0.
        stream = client.chat.completions.create(model="a0", max_tokens=200, stream=True, **ask)
        first = next(iter(stream))
        assert keyed.post("/v1/unload_lora_adapter", json={"lora_name": "a0"}).status_code == 200
        rest = list(stream)
        assert first.choices[0].delta is not None and rest[-1].choices[0].finish_reason
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="a0", max_tokens=4, **ask)
        again = keyed.post("/v1/unload_lora_adapter", json={"lora_name": "a0"})
        assert again.status_code == 404
    finally:
        node.stop()
