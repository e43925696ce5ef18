"""LoRA adapters through a cluster (router, 1 prefill, 2 decode; only decode-1 holds ``a1``),
driven with the ``openai`` SDK and plain HTTP, against a hybrid node with the same adapters:

* greedy text for the base and each adapter equals the hybrid node's, and differs from base;
* a decode node without an adapter never receives its handoffs; an adapter no pair holds
  is 404 ``model_not_found``; ``/v1/models`` lists the adapters with their parent;
* a second adapter request with the same prompt reuses the adapter's prefix (cached tokens)
  and gives the same text; a base request with that prompt reuses nothing of it;
* load/unload through the router while base and adapter requests run: none fails, the
  loaded adapter serves the hybrid's text, and after the unload it is 404.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LOOPBACK, NodeProcess, free_port, start_node

STARTUP_TIMEOUT_S = 300
BASE = "tiny"
SHORT = "Write a short story about a fox."
LONG = " ".join(f"Item {i}: the fox ran past tree {i * 7} near the river." for i in range(40))
MAX_LOAD_REQUESTS = 24  # the load loop's bound (count), besides its deadline
pytestmark = pytest.mark.timeout(900)


def write_adapters(tiny: Path, root: Path, seeds: range) -> dict[str, Path]:
    from mlx_lm.utils import load

    from engines.lora.random_adapter import write_random_adapter

    model, _ = load(str(tiny))
    return {f"a{s}": write_random_adapter(model, root / f"a{s}", seed=s) for s in seeds}


def node(role: str, workdir: Path, args: list[str], name: str) -> NodeProcess:
    bind = f"{LOOPBACK}:{free_port()}" if role in ("prefill", "decode") else None
    return start_node(role, workdir, args, serving_bind=bind, name=name)


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters-cluster")
    adapters = write_adapters(tiny_model_path, root, range(3))
    secret = root / "cluster.secret"
    generate_secret_file(secret)
    base = ["--model", str(tiny_model_path), "--served-model-name", BASE, "--no-warmup"]
    both = [f"--adapter=a0={adapters['a0']}", f"--adapter=a1={adapters['a1']}"]
    linked = [*base, "--cluster-secret-file", str(secret)]
    started: list[NodeProcess] = []
    try:
        nodes = {"hybrid": node("hybrid", root, [*base, *both], "hybrid"),
                 "prefill": node("prefill", root, [*linked, *both], "prefill"),
                 "decode-1": node("decode", root, [*linked, *both], "decode-1"),
                 "decode-2": node("decode", root, [*linked, both[0], "--enable-lora"],
                                  "decode-2")}  # fmt: skip
        started += nodes.values()
        decodes = ",".join(nodes[d].serving_bind for d in ("decode-1", "decode-2"))
        nodes["router"] = node("router", root, [
            *base[:4], "--cluster-secret-file", str(secret),
            "--prefill-peers", nodes["prefill"].serving_bind, "--decode-peers", decodes],
            "router")  # fmt: skip
        started.append(nodes["router"])
        for process in started:
            process.wait_healthy(STARTUP_TIMEOUT_S)
        wait_for_models(nodes["router"].url, {BASE, "a0", "a1"})
        yield nodes, adapters
    finally:
        for process in started:
            process.stop()


def wait_for_models(url: str, names: set[str], timeout_s: float = 30.0) -> None:
    """Adapters join /v1/models once the nodes' telemetry has announced them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if {card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]} == names:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url}/v1/models never listed exactly {sorted(names)}")


def chat(url: str, model: str, prompt: str = SHORT) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": prompt}])
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].message.content, (details.cached_tokens or 0) if details else 0


def handoffs_received(process: NodeProcess) -> float:
    text = httpx.get(f"{process.url}/metrics").text
    match = re.search(r"^mlxcel:kv_handoffs_received_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_each_adapter_gives_the_hybrid_text_through_the_cluster(cluster) -> None:
    nodes, _ = cluster
    router, hybrid = nodes["router"].url, nodes["hybrid"].url
    texts = {model: chat(router, model)[0] for model in (BASE, "a0", "a1")}
    assert texts == {model: chat(hybrid, model)[0] for model in texts}
    assert texts["a0"] != texts[BASE] and texts["a1"] != texts[BASE]
    cards = {card["id"]: card for card in httpx.get(f"{router}/v1/models").json()["data"]}
    assert cards["a0"]["parent"] == cards["a1"]["parent"] == BASE


def test_a_decode_node_without_the_adapter_never_gets_its_handoffs(cluster) -> None:
    nodes, _ = cluster
    before = handoffs_received(nodes["decode-2"]), handoffs_received(nodes["decode-1"])
    for i in range(4):
        chat(nodes["router"].url, "a1", f"{SHORT} ({i})")
    after = handoffs_received(nodes["decode-2"]), handoffs_received(nodes["decode-1"])
    assert after[0] == before[0] and after[1] == before[1] + 4
    with pytest.raises(openai.NotFoundError) as refused:
        chat(nodes["router"].url, "a9")
    assert refused.value.body["code"] == "model_not_found"


def test_adapter_prefix_reuse_is_keyed_by_adapter(cluster) -> None:
    nodes, _ = cluster
    router, hybrid = nodes["router"].url, nodes["hybrid"].url
    first, cached_first = chat(router, "a0", LONG)
    second, cached_second = chat(router, "a0", LONG)
    assert second == first == chat(hybrid, "a0", LONG)[0]
    assert cached_first == 0 and cached_second > 0
    base, cached_base = chat(router, BASE, LONG)
    assert cached_base == 0 and base == chat(hybrid, BASE, LONG)[0]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=120)


def test_load_and_unload_through_the_router_under_load(cluster) -> None:
    nodes, adapters = cluster
    router, hybrid = nodes["router"].url, nodes["hybrid"].url
    failures: list[str] = []
    done = threading.Event()
    count = [0]

    def keep_busy(model: str) -> None:
        deadline = time.monotonic() + 120
        while not done.is_set() and count[0] < MAX_LOAD_REQUESTS and time.monotonic() < deadline:
            count[0] += 1
            try:
                chat(router, model, f"{SHORT} {count[0]}")
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                failures.append(f"{model}: {exc!r}")

    workers = [threading.Thread(target=keep_busy, args=(m,)) for m in (BASE, "a0")]
    for worker in workers:
        worker.start()
    try:
        loaded = post(router, "load_lora_adapter", {"lora_name": "a2",
                                                     "lora_path": str(adapters["a2"])})
        assert loaded.status_code == 200, loaded.text
        assert len(loaded.json()["nodes"]) == 3  # the prefill node and both decode nodes
        assert post(hybrid, "load_lora_adapter", {"lora_name": "a2",
                                                  "lora_path": str(adapters["a2"])}).is_success
        assert chat(router, "a2")[0] == chat(hybrid, "a2")[0] != chat(hybrid, BASE)[0]
        unloaded = post(router, "unload_lora_adapter", {"lora_name": "a2"})
        assert unloaded.status_code == 200, unloaded.text
        with pytest.raises(openai.NotFoundError):
            chat(router, "a2")
    finally:
        done.set()
        for worker in workers:
            worker.join()
    assert not failures and count[0] > 0
    again = post(router, "unload_lora_adapter", {"lora_name": "a2"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
