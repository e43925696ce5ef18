"""LoRA adapters through a cluster (router, 1 prefill, 2 decode; only decode-1 holds ``a1``),
driven with the ``openai`` SDK and plain HTTP, against a hybrid node with the same adapters:

* greedy text for the base and each adapter equals the hybrid node's, and differs from base;
* a decode node without an adapter never receives its handoffs; an adapter no pair holds
  is 404 ``model_not_found``; ``/v1/models`` lists the adapters with their parent;
* a second adapter request with the same prompt reuses the adapter's prefix (cached tokens)
  and gives the same text; a base request with that prompt reuses nothing of it;
* load/unload through the router while base and adapter requests run: none fails, the
  loaded adapter serves the hybrid's text, and after the unload it is 404;
* a decode node added through the peers file after a run-time load is given that adapter by
  the router and then serves it; while it joins, base and adapter requests run: none fails.

The router finds its nodes in a peers file (re-read every 0.5 s).
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
from mlxcel_plugin.testing.membership_harness import (
    node_entry,
    router_stats,
    wait_until,
    write_peers_file,
)

STARTUP_TIMEOUT_S = 300
BASE = "tiny"
SHORT = "Write a short story about a fox."
LONG = " ".join(f"Item {i}: the fox ran past tree {i * 7} near the river." for i in range(40))
MAX_LOAD_REQUESTS = 24  # the load loop's bound (count), besides its deadline
LOAD_DEADLINE_S = 120
JOIN_TIMEOUT_S = 60
pytestmark = pytest.mark.timeout(900)


def write_adapters(tiny: Path, root: Path, seeds: range) -> dict[str, Path]:
    from mlx_lm.utils import load

    from engines.lora.random_adapter import write_random_adapter

    model, _ = load(str(tiny))
    return {f"a{s}": write_random_adapter(model, root / f"a{s}", seed=s) for s in seeds}


def node(role: str, workdir: Path, args: list[str], name: str,
         env: dict[str, str] | None = None) -> NodeProcess:  # fmt: skip
    bind = f"{LOOPBACK}:{free_port()}" if role in ("prefill", "decode") else None
    return start_node(role, workdir, args, serving_bind=bind, name=name, env=env)


def write_peers(root: Path, nodes: dict[str, NodeProcess], *decodes: str) -> None:
    write_peers_file(root / "peers.toml", [nodes["prefill"].serving_bind],
                     [nodes[name].serving_bind for name in ("decode-1", "decode-2", *decodes)])


def start_router(root: Path, nodes: dict[str, NodeProcess], args: list[str]) -> NodeProcess:
    write_peers(root, nodes)
    (root / "router.toml").write_text("[discovery]\ninterval_s = 0.5\n")
    return node("router", root, [*args, "--peers-file", str(root / "peers.toml"),
                                 "--distributed-config", str(root / "router.toml")],
                "router", env={"MLXCEL_ROUTER_STATS_VERBOSE": "1"})  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters-cluster")
    adapters = write_adapters(tiny_model_path, root, range(4))
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
        nodes["router"] = start_router(root, nodes, [*base[:4], "--cluster-secret-file",
                                                     str(secret)])  # fmt: skip
        started.append(nodes["router"])
        for process in started:
            process.wait_healthy(STARTUP_TIMEOUT_S)
        wait_for_models(nodes["router"].url, {BASE, "a0", "a1"})
        yield nodes, adapters, (root, linked)
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
    nodes, _, _ = cluster
    router, hybrid = nodes["router"].url, nodes["hybrid"].url
    texts = {model: chat(router, model)[0] for model in (BASE, "a0", "a1")}
    assert texts == {model: chat(hybrid, model)[0] for model in texts}
    assert texts["a0"] != texts[BASE] and texts["a1"] != texts[BASE]
    cards = {card["id"]: card for card in httpx.get(f"{router}/v1/models").json()["data"]}
    assert cards["a0"]["parent"] == cards["a1"]["parent"] == BASE


def test_a_decode_node_without_the_adapter_never_gets_its_handoffs(cluster) -> None:
    nodes, _, _ = cluster
    before = handoffs_received(nodes["decode-2"]), handoffs_received(nodes["decode-1"])
    for i in range(4):
        chat(nodes["router"].url, "a1", f"{SHORT} ({i})")
    after = handoffs_received(nodes["decode-2"]), handoffs_received(nodes["decode-1"])
    assert after[0] == before[0] and after[1] == before[1] + 4
    with pytest.raises(openai.NotFoundError) as refused:
        chat(nodes["router"].url, "a9")
    assert refused.value.body["code"] == "model_not_found"


def test_adapter_prefix_reuse_is_keyed_by_adapter(cluster) -> None:
    nodes, _, _ = cluster
    router, hybrid = nodes["router"].url, nodes["hybrid"].url
    first, cached_first = chat(router, "a0", LONG)
    second, cached_second = chat(router, "a0", LONG)
    assert second == first == chat(hybrid, "a0", LONG)[0]
    assert cached_first == 0 and cached_second > 0
    base, cached_base = chat(router, BASE, LONG)
    assert cached_base == 0 and base == chat(hybrid, BASE, LONG)[0]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=120)


class Busy:
    """Sequential chat requests on each model in a thread, bounded in count and time."""

    def __init__(self, url: str, models: tuple[str, ...]):
        self.url, self.failures, self.count = url, [], 0
        self.done = threading.Event()
        self.workers = [threading.Thread(target=self._run, args=(m,)) for m in models]

    def __enter__(self) -> Busy:
        for worker in self.workers:
            worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for worker in self.workers:
            worker.join()

    def _run(self, model: str) -> None:
        deadline = time.monotonic() + LOAD_DEADLINE_S
        while (not self.done.is_set() and self.count < MAX_LOAD_REQUESTS
               and time.monotonic() < deadline):  # fmt: skip
            self.count += 1
            try:
                chat(self.url, model, f"{SHORT} {self.count}")
            except Exception as exc:  # noqa: BLE001 - every failure is reported by the test
                self.failures.append(f"{model}: {exc!r}")


def test_load_and_unload_through_the_router_under_load(cluster) -> None:
    nodes, adapters, _ = cluster
    router, hybrid = nodes["router"].url, nodes["hybrid"].url
    with Busy(router, (BASE, "a0")) as busy:
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
    assert not busy.failures and busy.count > 0
    again = post(router, "unload_lora_adapter", {"lora_name": "a2"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"


def adapters_held(router: str, address: str) -> dict[str, str]:
    entry = node_entry(router_stats(router), "decode", address) or {}
    return (entry.get("telemetry") or {}).get("adapters") or {}  # None until its first probe


def first_handoff_on(router: str, late: NodeProcess, model: str) -> tuple[str, str]:
    """Requests on ``model`` (bounded) until ``late`` decodes one: (its prompt, its text)."""
    for i in range(MAX_LOAD_REQUESTS):
        before, prompt = handoffs_received(late), f"{SHORT} (late {i})"
        text = chat(router, model, prompt)[0]
        if handoffs_received(late) > before:
            return prompt, text
    raise AssertionError(f"the joined node decoded none of {MAX_LOAD_REQUESTS} {model} requests")


def test_a_decode_node_joining_after_a_run_time_load_gets_the_adapter(cluster) -> None:
    nodes, adapters, (root, linked) = cluster
    router = nodes["router"].url
    loaded = post(router, "load_lora_adapter", {"lora_name": "a3",
                                                 "lora_path": str(adapters["a3"])})
    assert loaded.status_code == 200, loaded.text
    nodes["decode-3"] = late = node("decode", root, [*linked, "--enable-lora"], "decode-3")
    try:
        late.wait_healthy(STARTUP_TIMEOUT_S)
        with Busy(router, (BASE, "a3")) as busy:
            write_peers(root, nodes, "decode-3")  # it joins with no adapter of its own
            wait_until(lambda: "a3" in adapters_held(router, late.serving_bind), JOIN_TIMEOUT_S)
        assert not busy.failures and busy.count > 0
        assert adapters_held(router, late.serving_bind)["a3"] == loaded.json()["digest"]
        prompt, text = first_handoff_on(router, late, "a3")
        hybrid = nodes["hybrid"].url
        assert post(hybrid, "load_lora_adapter", {"lora_name": "a3",
                                                  "lora_path": str(adapters["a3"])}).is_success
        assert text == chat(hybrid, "a3", prompt)[0] != chat(hybrid, BASE, prompt)[0]
    finally:
        write_peers(root, nodes)
        wait_until(lambda: node_entry(router_stats(router), "decode", late.serving_bind) is None,
                   JOIN_TIMEOUT_S)
        del nodes["decode-3"]
        late.stop()
        post(router, "unload_lora_adapter", {"lora_name": "a3"})
