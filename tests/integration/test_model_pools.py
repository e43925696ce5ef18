"""One router over several models (``[models.NAME]`` pools), each with its own prefill and decode
node, driven with the ``openai`` SDK: each request is served by its model's pool, with the
text a hybrid node of that model gives; an unknown model gets 404 ``model_not_found``;
``/v1/models`` and ``/metrics`` cover every model. An adapter loaded through the router
with ``base_model_name`` is served by its base's pool (the text of a hybrid node with the same
adapter), listed with its parent, refused to another pool, and 404 once unloaded.

The pools: two tiny checkpoints of different architectures (llama, qwen3) and, when this
module's ``smollm2`` test is selected, SmolLM2-135M with a seeded LoRA adapter given at start
to its nodes. Through that pool the adapter's greedy text differs from the base's and is the
text of the same adapter fused into the weights with mlx-lm. One cluster serves every test:
without the ``smollm2`` test (``-m 'not smollm2'``) it is started without SmolLM2.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LOOPBACK, NodeProcess, free_port, start_node

STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 300  # SmolLM2 on a loaded 2-core machine
MESSAGES = [{"role": "user", "content": "Write a short story about a fox."}]
TINY = ("tiny-llama", "tiny-qwen3")
SMOL, SMOL_ADAPTER = "smollm2", "smol-a"
SMOL_PROMPT = [1, 504, 3000, 28, 7, 95, 42, 17]  # token ids: the engine test's prompt
SMOL_STEPS = 8
LORA_POOL, LORA = "tiny-qwen3", "qwen-a"  # the pool whose nodes take adapters at run time
pytestmark = pytest.mark.timeout(900)


def smollm2_selected(request: pytest.FixtureRequest) -> bool:
    """Whether this run includes this module's SmolLM2 test (else its pool is left out)."""
    return any(item.get_closest_marker("smollm2") for item in request.session.items
               if item.path == request.path)  # fmt: skip


def write_adapter(model_path: Path, out: Path) -> Path:
    """A seeded adapter for a checkpoint (loaded lazily: only its shapes are read)."""
    from mlx_lm.utils import load

    from engines.lora.random_adapter import write_random_adapter

    return write_random_adapter(load(str(model_path), lazy=True)[0], out, seed=7, rank=4)


def fused_text(model_path: Path, adapter: Path) -> str:
    """The greedy text of ``adapter`` fused into SmolLM2's weights with mlx-lm."""
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    from tests.engines.lora.test_adapters import greedy

    model, tokenizer = load(str(model_path))
    model = load_adapters(model, str(adapter))
    fused = [(name, module.fuse()) for name, module in model.named_modules()
             if hasattr(module, "fuse")]  # fmt: skip
    model.update_modules(tree_unflatten(fused))
    tokens = greedy(model, [SMOL_PROMPT], SMOL_STEPS)[0]
    ends = [i for i, token in enumerate(tokens) if token in tokenizer.eos_token_ids]
    return tokenizer.decode(tokens[: ends[0] if ends else len(tokens)])


def engine_node(role: str, workdir: Path, name: str, args: list[str]) -> NodeProcess:
    return start_node(
        role,
        workdir,
        [*args, "--no-warmup"],
        serving_bind=f"{LOOPBACK}:{free_port()}",
        name=f"{role}-{name}",
    )


def pools_toml(models: dict[str, str], nodes: dict[str, list[NodeProcess]]) -> str:
    lines = []
    for name, model in models.items():
        prefill, decode = (n.serving_bind for n in nodes[name])
        lines += [
            f"[models.{name}]",
            f'model = "{model}"',
            f'prefill_peers = ["{prefill}"]',
            f'decode_peers = ["{decode}"]',
            "",
        ]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, tmp_path_factory, request):
    from engines.tiny_models import ensure_arch_model
    from tests.conftest import model_cache_root

    root = tmp_path_factory.mktemp("model-pools")
    models = {
        "tiny-llama": str(tiny_model_path),
        "tiny-qwen3": str(ensure_arch_model("qwen3", root=model_cache_root())),
    }
    extra: dict[str, list[str]] = {name: [] for name in models}
    extra[LORA_POOL] = ["--enable-lora"]
    reference: dict[str, str] = {}
    if smollm2_selected(request):
        models[SMOL] = str(request.getfixturevalue("smollm2_model_path"))
        adapter = write_adapter(Path(models[SMOL]), root / "adapter")
        extra[SMOL] = [f"--adapter={SMOL_ADAPTER}={adapter}"]
    secret = root / "cluster.secret"
    generate_secret_file(secret)
    started: list[NodeProcess] = []
    try:
        hybrids = {name: start_node("hybrid", root, ["--model", model, "--no-warmup",
                                                     "--served-model-name", name, *extra[name]],
                                    name=f"hybrid-{name}")
                   for name, model in models.items()}  # fmt: skip
        started += hybrids.values()
        linked = {name: ["--model", model, "--cluster-secret-file", str(secret), *extra[name]]
                  for name, model in models.items()}  # fmt: skip
        nodes = {name: [engine_node(role, root, name, linked[name])
                        for role in ("prefill", "decode")] for name in models}  # fmt: skip
        started += [node for pair in nodes.values() for node in pair]
        (root / "router.toml").write_text(pools_toml(models, nodes))
        router = start_node("router", root, [
            "--model", models["tiny-llama"], "--cluster-secret-file", str(secret),
            "--distributed-config", str(root / "router.toml")])  # fmt: skip
        started.append(router)
        if SMOL in models:  # in this process while the nodes start
            reference[SMOL_ADAPTER] = fused_text(Path(models[SMOL]), adapter)
        for node in started:
            node.wait_healthy(STARTUP_TIMEOUT_S)
        wait_routed(router, sum(len(pair) for pair in nodes.values()))
        reference[LORA] = str(write_adapter(Path(models[LORA_POOL]), root / LORA))
        yield router, hybrids, list(models), reference
    finally:
        for node in reversed(started):
            node.stop()


def wait_routed(router: NodeProcess, count: int, timeout_s: float = 60.0) -> None:
    """Until the router holds ``count`` nodes healthy: it dials a node that is still loading
    with a growing backoff, so a node healthy on its own may wait seconds for the router
    (SmolLM2's, loaded last, met a 503 "no healthy node" before)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded by the deadline
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        healthy = [line for line in metrics.splitlines()
                   if line.startswith("mlxcel:router_node_healthy{") and line.endswith(" 1.0")]
        if len(healthy) >= count:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the router holds fewer than {count} nodes healthy after {timeout_s}s")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                         timeout=REQUEST_TIMEOUT_S)  # fmt: skip


def greedy_text(url: str, model: str) -> str:
    reply = client(url).chat.completions.create(model=model, messages=MESSAGES, max_tokens=16,
                                                temperature=0)  # fmt: skip
    return reply.choices[0].message.content


def test_router_routes_each_model_to_its_pool(cluster) -> None:
    router, hybrids, names, _ = cluster
    expected = {name: greedy_text(hybrids[name].url, name) for name in TINY}
    assert expected["tiny-llama"] != expected["tiny-qwen3"]  # the weights differ
    for name in TINY:
        assert greedy_text(router.url, name) == expected[name], name
    with pytest.raises(openai.NotFoundError) as refused:
        greedy_text(router.url, "no-such-model")
    assert refused.value.code == "model_not_found"
    listed = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"]
    assert [card["id"] for card in listed if not card.get("parent")] == names
    assert all(card["max_model_len"] and card["owned_by"] for card in listed)
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    for name in TINY:
        assert f'mlxcel:generation_tokens_total{{model_name="{name}"}}' in metrics


def completion_text(url: str, model: str) -> str:
    reply = client(url).completions.create(model=model, prompt=SMOL_PROMPT,
                                           max_tokens=SMOL_STEPS, temperature=0)  # fmt: skip
    return reply.choices[0].text


def wait_for_card(url: str, name: str, timeout_s: float = 30.0) -> dict:
    """An adapter joins /v1/models once its nodes' telemetry has announced it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        if name in cards:
            return cards[name]
        time.sleep(0.1)
    raise AssertionError(f"{url}/v1/models never listed {name}")


@pytest.mark.smollm2
def test_smollm2_and_its_adapter_through_their_pool(cluster) -> None:
    router, hybrids, _, reference = cluster
    hybrid = hybrids[SMOL].url
    assert greedy_text(router.url, SMOL) == greedy_text(hybrid, SMOL)
    assert wait_for_card(router.url, SMOL_ADAPTER)["parent"] == SMOL
    adapted = completion_text(router.url, SMOL_ADAPTER)
    assert adapted == reference[SMOL_ADAPTER] == completion_text(hybrid, SMOL_ADAPTER)
    assert adapted != completion_text(router.url, SMOL)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT_S)


def test_an_adapter_loaded_through_the_router_is_served_by_its_base_pool(cluster) -> None:
    router, hybrids, _, reference = cluster
    load = {"lora_name": LORA, "lora_path": reference[LORA], "base_model_name": LORA_POOL}
    loaded = post(router.url, "/v1/load_lora_adapter", load)
    assert loaded.status_code == 200, loaded.text
    assert len(loaded.json()["nodes"]) == 2  # the pool's prefill and decode node
    assert post(hybrids[LORA_POOL].url, "/v1/load_lora_adapter", load).status_code == 200
    assert wait_for_card(router.url, LORA)["parent"] == LORA_POOL
    adapted = greedy_text(router.url, LORA)
    assert adapted == greedy_text(hybrids[LORA_POOL].url, LORA)
    assert adapted != greedy_text(router.url, LORA_POOL)
    elsewhere = post(router.url, "/v1/load_lora_adapter", {**load, "base_model_name": TINY[0]})
    assert (elsewhere.status_code, elsewhere.json()["error"]["param"]) == (400, "lora_name")
    unloaded = post(router.url, "/v1/unload_lora_adapter", {"lora_name": LORA})
    assert len(unloaded.json()["nodes"]) == 2, unloaded.text
    with pytest.raises(openai.NotFoundError) as refused:
        greedy_text(router.url, LORA)
    assert refused.value.code == "model_not_found"
