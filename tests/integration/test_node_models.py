"""One hybrid node serving two models (``--model NAME=PATH`` twice, ``--max-loaded-models 1``),
driven with the ``openai`` SDK: each request gets its model's answer, byte-identical to a node
of that model alone; an idle model is evicted for the other (log, metric, ``/v1/models``) and
reloaded on its next request; a model that is streaming is never evicted: the other model's
request waits (``--model-wait-s``) and the stream completes intact. Bad ``--model`` specs are
one-line CLI errors.

Two tiny checkpoints of different architectures (llama, qwen3), no warmup.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel_plugin.local_cluster import NodeProcess, start_node

STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 120
MESSAGES = [{"role": "user", "content": "Write a short story about a fox."}]
LONG_TOKENS = 400  # a stream of seconds on a tiny model: the other model's request meets it
NAMES = ("llama", "qwen3")
pytestmark = pytest.mark.timeout(900)


def client(node: NodeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="none", max_retries=0,
                         timeout=REQUEST_TIMEOUT_S)  # fmt: skip


def greedy_text(node: NodeProcess, model: str, max_tokens: int = 16) -> str:
    reply = client(node).chat.completions.create(model=model, messages=MESSAGES,
                                                 max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


def streamed_text(node: NodeProcess, model: str, first_chunk: threading.Event) -> str:
    stream = client(node).chat.completions.create(model=model, messages=MESSAGES,
                                                  max_tokens=LONG_TOKENS, temperature=0,
                                                  stream=True)  # fmt: skip
    parts = []
    for chunk in stream:
        first_chunk.set()
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def loaded(node: NodeProcess) -> dict[str, bool]:
    cards = httpx.get(f"{node.url}/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["loaded"] for card in cards}


def metric(node: NodeProcess, name: str, model: str) -> float:
    text = httpx.get(f"{node.url}/metrics", timeout=10).text
    found = re.search(rf'^mlxcel:model_{name}{{model_name="{model}"}} (\S+)$', text, re.M)
    assert found, f"no mlxcel:model_{name} for {model}"
    return float(found.group(1))


@pytest.fixture(scope="module")
def checkpoints(tiny_model_path: Path) -> dict[str, str]:
    from engines.tiny_models import ensure_arch_model
    from tests.conftest import model_cache_root

    return {"llama": str(tiny_model_path),
            "qwen3": str(ensure_arch_model("qwen3", root=model_cache_root()))}  # fmt: skip


@pytest.fixture(scope="module")
def served(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[NodeProcess, dict[str, str]]]:  # fmt: skip
    """The two-model node, and each model's answers from a node serving it alone."""
    workdir = tmp_path_factory.mktemp("node-models")
    specs = [arg for name in NAMES for arg in ("--model", f"{name}={checkpoints[name]}")]
    node = start_node("hybrid", workdir, [*specs, "--max-loaded-models", "1", "--no-warmup",
                                          "--model-wait-s", "120"], name="two-models")
    alone = {name: start_node("hybrid", workdir, ["--model", path, "--served-model-name", name,
                                                  "--no-warmup"], name=f"alone-{name}")
             for name, path in checkpoints.items()}  # fmt: skip
    try:
        for started in (node, *alone.values()):
            started.wait_healthy(STARTUP_TIMEOUT_S)
        references = {name: greedy_text(one, name) for name, one in alone.items()}
        references["llama-long"] = streamed_text(alone["llama"], "llama", threading.Event())
        for one in alone.values():
            one.stop()
        yield node, references
    finally:
        for started in (node, *alone.values()):
            started.stop()


def test_each_model_answers_as_a_node_serving_it_alone(served) -> None:
    node, references = served
    for name in (*NAMES, *NAMES):  # the second round reloads each model after an eviction
        assert greedy_text(node, name) == references[name]
    assert references["llama"] != references["qwen3"]
    assert set(loaded(node)) == set(NAMES)
    scrape = httpx.get(f"{node.url}/metrics", timeout=10).text
    for name in NAMES:  # the front's and the engine's series, per model
        assert f'mlxcel:prefix_cache_lookup_tokens_total{{model_name="{name}"}}' in scrape
    with pytest.raises(openai.NotFoundError) as missing:
        greedy_text(node, "no-such-model")
    assert missing.value.body["code"] == "model_not_found"


def test_the_idle_model_is_evicted_then_reloaded(served) -> None:
    node, references = served
    greedy_text(node, "llama")
    assert loaded(node) == {"llama": True, "qwen3": False}
    evictions = metric(node, "evictions_total", "llama")
    loads = metric(node, "loads_total", "llama")
    assert greedy_text(node, "qwen3") == references["qwen3"]
    assert loaded(node) == {"llama": False, "qwen3": True}
    assert metric(node, "evictions_total", "llama") == evictions + 1
    assert metric(node, "loaded", "llama") == 0 and metric(node, "loaded", "qwen3") == 1
    assert "evicting model llama (idle, least recently used) to load qwen3" in node.log_tail(200)
    assert greedy_text(node, "llama") == references["llama"]
    assert metric(node, "loads_total", "llama") == loads + 1


def test_a_streaming_model_is_never_evicted(served) -> None:
    node, references = served
    greedy_text(node, "llama")  # loaded, and the only model loaded
    waits = metric(node, "waits_total", "qwen3")
    first_chunk, results, ended = threading.Event(), {}, {}

    def stream_llama() -> None:
        results["llama"] = streamed_text(node, "llama", first_chunk)
        ended["llama"] = time.monotonic()

    streaming = threading.Thread(target=stream_llama)
    streaming.start()
    assert first_chunk.wait(REQUEST_TIMEOUT_S)
    results["qwen3"] = greedy_text(node, "qwen3")  # waits for llama's stream to end
    ended["qwen3"] = time.monotonic()
    streaming.join(REQUEST_TIMEOUT_S)
    assert results["llama"] == references["llama-long"]
    assert results["qwen3"] == references["qwen3"]
    assert ended["llama"] < ended["qwen3"]
    assert metric(node, "waits_total", "qwen3") == waits + 1


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxcel_plugin.cli", *args], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))  # fmt: skip


@pytest.mark.parametrize(("spec", "message"), [
    (["a/b=PATH"], "'a/b' is not a model name"),
    (["x=PATH", "x=PATH"], "the name 'x' is given twice"),
    (["x=/no/such/checkpoint"], "/no/such/checkpoint is not a checkpoint directory"),
    (["x=PATH", "y=PATH", "--node-role", "decode", "--serving-bind", "127.0.0.1:9"],
     "--node-role decode serves one model: give --model once"),
])  # fmt: skip
def test_bad_model_specs_are_one_line_errors(tiny_model_path, spec, message) -> None:
    args = [arg.replace("PATH", str(tiny_model_path)) for arg in spec]
    argv = [item for arg in args for item in (["--model", arg] if "=" in arg else [arg])]
    done = run_cli(*argv, "--port", "9")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("mlxcel-server: error: --model") or "--node-role" in lines[0]
    assert message in lines[0]
