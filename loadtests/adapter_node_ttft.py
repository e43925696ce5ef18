"""``POST /v1/load_lora_adapter`` on a real hybrid node, then the time to first token on it.

For ``bench_adapters.py``: one hybrid node (``--enable-lora``) on 127.0.0.1; the base is
asked first (a warm engine); then the adapter is loaded over HTTP and, at once, a
streaming completion names it. Reported: the load's HTTP round trip, the first token
of that request (the engine's first forward with the new adapter's layers), and the
base request's first token with the same prompt length for comparison.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtests.bench_common import stream_request
from mlxcel_plugin.local_cluster import start_node

STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 300
SERVED = "base"


@dataclass(frozen=True)
class NodeLoadTiming:
    base_ttft_s: float
    load_s: float
    adapter_ttft_s: float


def _ttft_s(client: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "stream": True}  # fmt: skip
    result = stream_request(client, url, "completion", "/v1/completions", body)
    if not result.ok or result.ttft_s is None:
        raise RuntimeError(f"{model}: {result.error}")
    return result.ttft_s


def node_load_timing(model_path: Path, adapter: Path, workdir: Path,
                     prompt: list[int]) -> NodeLoadTiming:  # fmt: skip
    node = start_node("hybrid", workdir, ["--model", str(model_path), "--served-model-name",
                                          SERVED, "--enable-lora"], name="bench-adapters")
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            _ttft_s(client, node.url, SERVED, prompt)  # the first request's one-off costs
            base_s = _ttft_s(client, node.url, SERVED, prompt[::-1])
            start = time.perf_counter()
            reply = client.post(f"{node.url}/v1/load_lora_adapter",
                                json={"lora_name": "fresh", "lora_path": str(adapter)})
            load_s = time.perf_counter() - start
            reply.raise_for_status()
            adapter_s = _ttft_s(client, node.url, "fresh", prompt)
        return NodeLoadTiming(base_s, load_s, adapter_s)
    finally:
        node.stop()
