"""A real router + prefill + decode cluster on 127.0.0.1 (LocalCluster), driven over HTTP.

Fault, capacity and concurrency tests run nodes with the zero-cost ``fake``
engine; the parity test runs ``mlx`` nodes on the tiny checkpoint and
compares every response body with a hybrid node's, byte for byte after
normalizing ``id`` and ``created``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.local_cluster import LocalCluster, NodeProcess, start_node

STARTUP_TIMEOUT_S = 180
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Write a short story about a fox."}]
pytestmark = pytest.mark.timeout(600)


def fake_model_dir(root: Path, tiny: Path, **knobs: float) -> str:
    """The tiny checkpoint's tokenizer and config (no weights) plus fake-engine knobs."""
    root.mkdir(parents=True, exist_ok=True)
    for path in tiny.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, root / path.name)
    (root / "fake_engine.json").write_text(json.dumps(knobs))
    return str(root)


def start_cluster(workdir: Path, model: str, *, engine: str, prefill: int, decode: int,
                  toml: str | None = None) -> LocalCluster:
    # Round robin: the fault tests count on back-to-back requests landing on different nodes.
    args = ["--engine", engine, "--served-model-name", MODEL, "--no-warmup",
            "--prefill-balancer", "round-robin", "--decode-balancer", "round-robin"]
    if toml is not None:
        path = workdir / "cluster.toml"
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(toml)
        args += ["--distributed-config", str(path)]
    cluster = LocalCluster(workdir=workdir, model=model, prefill_count=prefill,
                           decode_count=decode, common_args=args,
                           env={"MLXCEL_ROUTER_STATS_VERBOSE": "1"})
    return cluster.start(STARTUP_TIMEOUT_S)


def stats(cluster: LocalCluster) -> dict:
    return httpx.get(f"{cluster.router.url}/router/stats", timeout=10).json()


def node_stats(cluster: LocalCluster, node_id: str) -> dict:
    entries = [e for role in stats(cluster)["nodes"].values() for e in role]
    return next(e for e in entries if e["id"] == node_id)


def wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded by the deadline
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError("condition not met in time")


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


# -- fake engine: traffic, faults, concurrency -----------------------------------


@pytest.fixture(scope="module")
def fake_cluster(tiny_model_path: Path, tmp_path_factory) -> Iterator[LocalCluster]:
    workdir = tmp_path_factory.mktemp("router-fake")
    model = fake_model_dir(workdir / "model", tiny_model_path, decode_step_s=0.002)
    cluster = start_cluster(workdir, model, engine="fake", prefill=2, decode=2)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client(fake_cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{fake_cluster.router.url}/v1", api_key="none",
                       max_retries=0, timeout=60) as c:  # fmt: skip
        yield c


def test_api_surface(fake_cluster: LocalCluster, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{fake_cluster.router.url}/health").json() == {"status": "ok"}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, stream=True) if c.choices)
    assert text == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert c.usage.completion_tokens == 8
    metrics = httpx.get(f"{fake_cluster.router.url}/metrics").text
    assert "mlxcel:router_requests_total" in metrics and "mlxcel:time_to_first_token" in metrics


def test_both_pools_receive_traffic(fake_cluster: LocalCluster, client: openai.OpenAI) -> None:
    for i in range(8):
        client.completions.create(model=MODEL, prompt=f"count {i}", max_tokens=4)
    body = stats(fake_cluster)
    for role in ("prefill", "decode"):
        assert [e["id"] for e in body["nodes"][role]] == [f"{role}-0", f"{role}-1"]
        assert all(e["dispatched"] > 0 and e["health"] == "healthy" for e in body["nodes"][role])
    assert body["metrics"]["completed"] >= 8 and body["metrics"]["failed"] == 0


def test_stats_redact_addresses_unless_verbose(tiny_model_path: Path, tmp_path) -> None:
    from mlxcel_plugin.config import build_config
    from mlxcel_plugin.plugins import load_plugins
    from router_plugin.roles import make_router_app

    secret = tmp_path / "s"
    secret.write_text("ab" * 32)
    config = build_config({"role": "router", "model": str(tiny_model_path),
                           "prefill_peers": "127.0.0.1:1", "decode_peers": "127.0.0.1:2",
                           "cluster_secret_file": str(secret)}, env={})
    for env, shown in (({}, "<redacted>"), ({"MLXCEL_ROUTER_STATS_VERBOSE": "1"}, "127.0.0.1:1")):
        app = make_router_app(config, load_plugins(env={}), env=env)
        route = next(r for r in app.routes if getattr(r, "path", "") == "/router/stats")
        assert route.endpoint()["nodes"]["prefill"][0]["address"] == shown


def test_32_concurrent_openai_streams(fake_cluster: LocalCluster, client) -> None:
    prompts = [[{"role": "user", "content": f"Tell me about the number {i}."}]
               for i in range(32)]
    expected = [client.chat.completions.create(model=MODEL, messages=m, max_tokens=32)
                .choices[0].message.content for m in prompts]

    async def one(c: openai.AsyncOpenAI, messages) -> str:
        stream = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                                 stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{fake_cluster.router.url}/v1", api_key="none",
                                      max_retries=0, timeout=120) as c:  # fmt: skip
            return list(await asyncio.gather(*(one(c, m) for m in prompts)))

    assert asyncio.run(run()) == expected
    assert len(set(expected)) > 1


def _stream_lines(url: str, prompt: str, max_tokens: int) -> list[str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return sse_lines(r)


def test_kill_decode_mid_stream_migrates_its_requests(fake_cluster: LocalCluster) -> None:
    url = fake_cluster.router.url
    doomed = fake_cluster.pool("decode")[0]
    bodies = {"model": MODEL, "max_tokens": 1500, "stream": True}
    with httpx.Client(timeout=60) as http:
        # Round robin: two back-to-back requests land on different decode nodes.
        streams = [http.stream("POST", f"{url}/v1/completions",
                               json={**bodies, "prompt": f"long {i}"}) for i in range(2)]
        responses = [s.__enter__() for s in streams]
        try:
            iters = [r.iter_lines() for r in responses]
            heads = [[next(it) for _ in range(6)] for it in iters]
            doomed.process.kill()
            doomed.process.wait(10)
            tails = [[line for line in it if line] for it in iters]
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    outcomes = []
    for head, tail in zip(heads, tails, strict=True):
        lines = [line for line in head + tail if line]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        errors = [e for e in events if "error" in e]
        outcomes.append("error" if errors else events[-1]["choices"][0]["finish_reason"])
        assert len(errors) <= 1
    # The stream on the killed node moved to the other one (docs/cluster-flow.md, "Migration").
    assert outcomes == ["length", "length"]
    assert stats(fake_cluster)["metrics"]["migrated"] >= 1
    wait_until(lambda: node_stats(fake_cluster, "decode-0")["health"] == "unreachable")
    # Later requests avoid the dead node.
    for i in range(4):
        assert _stream_lines(url, f"after {i}", 4)[-1] == "data: [DONE]"
    fake_cluster.nodes.remove(doomed)
    restart(fake_cluster, doomed)
    wait_until(lambda: node_stats(fake_cluster, "decode-0")["health"] == "healthy")


def restart(cluster: LocalCluster, dead: NodeProcess) -> NodeProcess:
    """The same node again: same serving bind, same flags, fresh HTTP port."""
    node = start_node(dead.role, cluster.workdir, cluster.node_args(), env=cluster.env,
                      serving_bind=dead.serving_bind)
    cluster.nodes.append(node)
    node.wait_healthy(STARTUP_TIMEOUT_S)
    return node


def test_kill_prefill_reroutes_then_uses_it_again(fake_cluster: LocalCluster, client) -> None:
    dead = fake_cluster.pool("prefill")[0]
    dead.process.kill()
    dead.process.wait(10)
    fake_cluster.nodes.remove(dead)
    for i in range(6):
        r = client.completions.create(model=MODEL, prompt=f"while down {i}", max_tokens=4)
        assert r.choices[0].finish_reason == "length"
    assert node_stats(fake_cluster, "prefill-0")["health"] == "unreachable"
    restart(fake_cluster, dead)
    wait_until(lambda: node_stats(fake_cluster, "prefill-0")["health"] == "healthy")
    before = node_stats(fake_cluster, "prefill-0")["dispatched"]
    for i in range(4):
        client.completions.create(model=MODEL, prompt=f"back {i}", max_tokens=4)
    assert node_stats(fake_cluster, "prefill-0")["dispatched"] > before
    assert stats(fake_cluster)["metrics"]["failed"] == 0  # the killed decode's stream migrated


# -- capacity ------------------------------------------------------------------------

TINY_CAPACITY = """
[backpressure]
node_capacity_requests = 1
moderate_utilization = 0.5
high_utilization = 0.5
critical_utilization = 0.5
moderate_action = "reject"
high_action = "reject"
critical_action = "reject"
retry_after_s = 2.0
"""


def test_every_node_at_capacity_answers_503_with_retry_after(tiny_model_path: Path,
                                                             tmp_path_factory) -> None:
    workdir = tmp_path_factory.mktemp("router-capacity")
    model = fake_model_dir(workdir / "model", tiny_model_path, decode_step_s=0.01)
    cluster = start_cluster(workdir, model, engine="fake", prefill=1, decode=1,
                            toml=TINY_CAPACITY)
    try:
        url = cluster.router.url
        body = {"model": MODEL, "prompt": "hold", "max_tokens": 1000, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{url}/v1/completions", json=body
        ) as busy:
            lines = busy.iter_lines()
            next(lines)
            r = http.post(f"{url}/v1/completions",
                          json={"model": MODEL, "prompt": "more", "max_tokens": 4})
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "2"
            assert r.json()["error"]["code"] == "at_capacity"
        assert stats(cluster)["metrics"]["rejected"] >= 1
    finally:
        cluster.stop()


# -- parity with hybrid on the tiny checkpoint (engine "mlx") ----------------------

THINK = [{"role": "user", "content": "Think first. <think>"}]
PARITY_CASES = [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": THINK, "max_tokens": 16}),
    ("/v1/chat/completions", {"messages": THINK, "max_tokens": 16, "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.8,
                              "seed": 7}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.8,
                              "seed": 7, "stream": True}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16, "stream": True}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1}),
    ("/v1/completions", {"prompt": "<think>\nHmm", "max_tokens": 16, "temperature": 0.7,
                         "seed": 3, "stream": True}),
]


def normalize(body: str) -> str:
    """Drop ``id`` and ``created`` from every JSON object of a body or an SSE stream."""
    def strip(text: str) -> str:
        obj = json.loads(text)
        if isinstance(obj, dict):
            obj.pop("id", None)
            obj.pop("created", None)
        return json.dumps(obj, sort_keys=False)

    if not body.startswith("data: "):
        return strip(body)
    out = []
    for line in body.split("\n"):
        if line.startswith("data: {"):
            line = "data: " + strip(line[6:])
        out.append(line)
    return "\n".join(out)


def bodies(url: str) -> list[str]:
    out = []
    with httpx.Client(timeout=300) as http:
        for path, body in PARITY_CASES:
            r = http.post(f"{url}{path}", json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
            out.append(normalize(r.text))
    return out


def test_parity_with_hybrid_on_the_tiny_checkpoint(tiny_model_path: Path,
                                                   tmp_path_factory) -> None:
    workdir = tmp_path_factory.mktemp("router-parity")
    model = str(tiny_model_path)
    hybrid = start_node("hybrid", workdir, ["--model", model, "--served-model-name", MODEL,
                                            "--no-warmup"])
    try:
        hybrid.wait_healthy(STARTUP_TIMEOUT_S)
        expected = bodies(hybrid.url)
    finally:
        hybrid.stop()
    cluster = start_cluster(workdir, model, engine="mlx", prefill=1, decode=1)
    try:
        routed = bodies(cluster.router.url)
    finally:
        cluster.stop()
    for case, want, got in zip(PARITY_CASES, expected, routed, strict=True):
        assert got == want, case
