"""``examples/litellm/config.yaml`` runs as shipped: the real proxy, that file, unchanged.

Chat completions, LiteLLM's ``/v1/responses`` and ``/v1/messages`` (bridged by LiteLLM
onto the mlxcel provider's chat completion), plain and streamed, through the SDKs.

The cluster is started where the config points (prefill 127.0.0.1:9101, decode
127.0.0.1:9201, ``cluster.secret`` in the proxy's working directory); the
model comes from ``MLXCEL_MODEL`` as the config's comment says. docs/litellm.md
shows the same file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
import yaml

from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LOOPBACK, free_port, start_node
from tests.integration.test_litellm_provider import OFFLINE_ENV, stop, wait_alive

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "litellm" / "config.yaml"
PROXY_START_TIMEOUT_S = 120

pytestmark = pytest.mark.timeout(300)


def shipped() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def port_free(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as sock:
        try:
            sock.bind((host, int(port)))
        except OSError:
            return False
    return True


def test_the_docs_show_the_committed_config() -> None:
    page = (REPO / "docs" / "litellm.md").read_text()
    assert CONFIG.read_text() in page
    assert shipped()["router_settings"]["num_retries"] == 0


@pytest.fixture(scope="module")
def example_cluster(tiny_model_path: Path, tmp_path_factory) -> Iterator[Path]:
    params = shipped()["model_list"][0]["litellm_params"]
    binds = {"prefill": params["prefill_peers"], "decode": params["decode_peers"]}
    busy = [bind for bind in binds.values() if not port_free(bind)]
    if busy:
        pytest.skip(f"the example's ports are taken on this machine: {busy}")
    workdir = tmp_path_factory.mktemp("litellm-example")
    generate_secret_file(workdir / params["cluster_secret_file"])
    args = ["--cluster-secret-file", str(workdir / params["cluster_secret_file"]),
            "--model", str(tiny_model_path), "--engine", "fake", "--no-warmup"]  # fmt: skip
    nodes = [start_node(role, workdir, args, serving_bind=bind) for role, bind in binds.items()]
    try:
        for node in nodes:
            node.wait_healthy(120)
        yield workdir
    finally:
        for node in nodes:
            node.stop()


def check_responses(client: openai.OpenAI, name: str) -> None:
    """LiteLLM's ``/v1/responses``, bridged onto the provider's chat completion."""
    response = client.responses.create(model=name, input="Hi", max_output_tokens=8)
    assert response.status == "completed" or response.incomplete_details is not None
    assert response.output and response.output[0].type == "message"
    assert response.usage.output_tokens >= 1
    events = list(client.responses.create(model=name, input="Hi", max_output_tokens=8,
                                          stream=True))  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created", kinds
    assert "response.output_text.delta" in kinds, kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert events[-1].response.usage.output_tokens >= 1


def check_messages(url: str, key: str, name: str) -> None:
    """LiteLLM's ``/v1/messages`` (Anthropic's SDK), bridged onto the provider's chat."""
    with anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60) as client:
        message = client.messages.create(model=name, max_tokens=8,
                                         messages=[{"role": "user", "content": "Hi"}])
        assert message.stop_reason in ("end_turn", "max_tokens")
        assert message.content[0].type == "text" and message.usage.output_tokens >= 1
        events = list(client.messages.create(model=name, max_tokens=8, stream=True,
                                             messages=[{"role": "user", "content": "Hi"}]))
        kinds = [event.type for event in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        assert "content_block_delta" in kinds, kinds
        delta = next(e for e in events if e.type == "message_delta")
        assert delta.delta.stop_reason in ("end_turn", "max_tokens"), kinds


def test_proxy_serves_with_the_shipped_config(example_cluster: Path, tiny_model_path) -> None:
    port = free_port()
    argv = [str(Path(sys.executable).parent / "litellm"), "--config", str(CONFIG),
            "--host", LOOPBACK, "--port", str(port)]  # fmt: skip
    env = {**os.environ, **OFFLINE_ENV, "MLXCEL_MODEL": str(tiny_model_path)}
    for name in ("MLXCEL_PREFILL_PEERS", "MLXCEL_DECODE_PEERS", "MLXCEL_CLUSTER_SECRET_FILE"):
        env.pop(name, None)  # only what the config says
    log_path = example_cluster / "proxy.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=example_cluster, env=env)  # fmt: skip
    url = f"http://{LOOPBACK}:{port}"
    try:
        try:
            wait_alive(url, process, PROXY_START_TIMEOUT_S)
        except (RuntimeError, TimeoutError):
            pytest.fail(f"proxy did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
        config = shipped()
        key = config["general_settings"]["master_key"]
        name = config["model_list"][0]["model_name"]
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                           timeout=60) as client:  # fmt: skip
            reply = client.chat.completions.create(
                model=name, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
            assert reply.choices[0].finish_reason in ("stop", "length")
            assert reply.usage.completion_tokens >= 1
            chunks = list(client.chat.completions.create(
                model=name, max_tokens=8, stream=True,
                messages=[{"role": "user", "content": "Hi"}]))
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in (
                "stop", "length")
            check_responses(client, name)
        check_messages(url, key, name)
    finally:
        stop(process)
