"""Hung nodes and graceful drain, on real processes with the ``fake`` engine.

A SIGSTOPped decode node is marked unreachable within the health deadline and
gets no new requests; SIGTERM on each role (decode, prefill, router, hybrid)
lets the stream in flight finish, refuses new work meanwhile, and exits 0;
the quick start's SIGTERM leaves no node behind. Every process started here
is stopped by PID in a ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from mlxcel_plugin.local_cluster import LocalCluster, NodeProcess, free_port, start_node
from tests.integration.test_router_cluster import (
    MODEL,
    STARTUP_TIMEOUT_S,
    fake_model_dir,
    start_cluster,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
# Health defaults: 1.5 s of silence, checked every 0.5 s; the rest is slack for a loaded CI.
UNREACHABLE_DEADLINE_S = 10.0
EXIT_DEADLINE_S = 30.0
LONG_STREAM_TOKENS = 250  # at 0.02 s a step: ~5 s, long enough to signal mid-stream


def node_entry(cluster: LocalCluster, node_id: str) -> dict:
    body = httpx.get(f"{cluster.router.url}/router/stats", timeout=10).json()
    return next(e for role in body["nodes"].values() for e in role if e["id"] == node_id)


def node_id_of(cluster: LocalCluster, node: NodeProcess) -> str:
    index = cluster.pool(node.role).index(node)
    return f"{node.role}-{index}"


def complete(url: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@contextmanager
def open_stream(url: str, prompt: str, max_tokens: int = LONG_STREAM_TOKENS) -> Iterator:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        yield (line for line in response.iter_lines() if line)


def finish_reason(lines: list[str]) -> str:
    """The stream ended cleanly: no error event, one finish reason, then [DONE]."""
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert not [e for e in events if "error" in e], events[-3:]
    return events[-1]["choices"][0]["finish_reason"]


def status(url: str) -> int:
    return httpx.get(url, timeout=10).status_code


def wait_exit(node: NodeProcess) -> int:
    return node.process.wait(timeout=EXIT_DEADLINE_S)


@pytest.fixture
def model(tiny_model_path: Path, tmp_path: Path) -> str:
    return fake_model_dir(tmp_path / "model", tiny_model_path, decode_step_s=0.02)


@pytest.fixture
def one_prefill_two_decode(model: str, tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = start_cluster(tmp_path / "cluster", model, engine="fake", prefill=1, decode=2)
    try:
        yield cluster
    finally:
        cluster.stop()


# -- hung nodes -------------------------------------------------------------------------


def test_a_sigstopped_decode_node_is_unreachable_fast_and_gets_no_new_requests(
        one_prefill_two_decode: LocalCluster) -> None:
    cluster = one_prefill_two_decode
    url = cluster.router.url
    assert complete(url, "warm up").status_code == 200
    hung = cluster.pool("decode")[0]
    os.kill(hung.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        wait_until(lambda: node_entry(cluster, "decode-0")["health"] == "unreachable",
                   UNREACHABLE_DEADLINE_S)
        print(f"SIGSTOPped decode node unreachable after {time.monotonic() - started:.2f}s")
        before = node_entry(cluster, "decode-1")["dispatched"]
        for i in range(4):
            response = complete(url, f"while hung {i}")
            assert response.status_code == 200
            assert response.json()["choices"][0]["finish_reason"] == "length"
        assert node_entry(cluster, "decode-1")["dispatched"] == before + 4
        assert node_entry(cluster, "decode-0")["health"] == "unreachable"
    finally:
        os.kill(hung.process.pid, signal.SIGCONT)


def streamed_text(lines: list[str]) -> str:
    events = [json.loads(line[6:]) for line in lines[:-1]]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def test_a_stream_waits_for_its_only_decode_node_to_come_back(tiny_model_path: Path,
                                                              tmp_path: Path) -> None:
    """The only decode node dies mid-stream and a new one starts at its address: the request,
    with no pair left to move to (the router's one re-probe is refused), waits for it
    (``[router] migration_wait_s``) and ends with the fault-free text instead of an error."""
    model = fake_model_dir(tmp_path / "model", tiny_model_path, autoregressive=True,
                           decode_step_s=0.02)
    cluster = start_cluster(tmp_path / "cluster", model, engine="fake", prefill=1, decode=1,
                            toml="[router]\nmigration_wait_s = 120\n")  # a loaded CI's start
    try:
        url, dead = cluster.router.url, cluster.pool("decode")[0]
        with open_stream(url, "a long story", max_tokens=120) as lines:
            fault_free = list(lines)
        with open_stream(url, "a long story", max_tokens=120) as lines:
            head = [next(lines) for _ in range(3)]
            dead.process.kill()
            dead.process.wait()
            cluster.nodes.remove(dead)
            cluster.start_engine_node("decode", dead.serving_bind).wait_healthy(
                STARTUP_TIMEOUT_S)
            tail = list(lines)
        assert finish_reason(head + tail) == "length"
        assert streamed_text(head + tail) == streamed_text(fault_free)
        assert httpx.get(f"{url}/router/stats", timeout=10).json()["metrics"]["migrated"] == 1
    finally:
        cluster.stop()


# -- drain: node roles ------------------------------------------------------------------


def test_sigterm_drains_a_decode_node_its_stream_finishes_and_it_exits_0(
        one_prefill_two_decode: LocalCluster) -> None:
    cluster = one_prefill_two_decode
    url = cluster.router.url
    with open_stream(url, "a long story") as lines:
        head = [next(lines) for _ in range(3)]
        busy = next(n for n in cluster.pool("decode")
                    if node_entry(cluster, node_id_of(cluster, n))["in_flight"] == 1)
        busy_id = node_id_of(cluster, busy)
        busy.process.terminate()
        wait_until(lambda: node_entry(cluster, busy_id)["health"] == "draining", 10)
        assert status(f"{busy.url}/health/ready") == 503
        assert status(f"{busy.url}/health") == 503
        assert status(f"{busy.url}/health/live") == 200
        for i in range(3):  # new work goes to the other decode node
            assert complete(url, f"while draining {i}").status_code == 200
        assert busy.process.poll() is None  # still finishing the stream
        tail = list(lines)
    assert finish_reason(head + tail) == "length"
    assert wait_exit(busy) == 0


def test_sigterm_on_a_prefill_node_mid_prefill_still_completes_the_request(
        tiny_model_path: Path, tmp_path: Path) -> None:
    model = fake_model_dir(tmp_path / "model", tiny_model_path, decode_step_s=0.005,
                           prefill_s_per_token=0.1)
    cluster = start_cluster(tmp_path / "cluster", model, engine="fake", prefill=1, decode=1)
    try:
        prefill = cluster.pool("prefill")[0]
        with open_stream(cluster.router.url, "a prompt of a few words to prefill slowly",
                         max_tokens=40) as lines:
            wait_until(lambda: node_entry(cluster, "prefill-0")["in_flight"] == 1, 10)
            prefill.process.terminate()
            body = list(lines)
        assert finish_reason(body) == "length"
        assert wait_exit(prefill) == 0
    finally:
        cluster.stop()


# -- drain: HTTP roles ------------------------------------------------------------------


def test_sigterm_drains_the_router_its_stream_finishes_new_requests_get_503(
        model: str, tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path / "cluster", model, engine="fake", prefill=1, decode=1)
    try:
        router = cluster.router
        with open_stream(router.url, "a long story") as lines:
            head = [next(lines) for _ in range(3)]
            router.process.terminate()
            wait_until(lambda: status(f"{router.url}/health/ready") == 503, 10)
            assert status(f"{router.url}/health") == 503
            assert status(f"{router.url}/health/live") == 200
            refused = complete(router.url, "too late")
            assert refused.status_code == 503 and "retry-after" in refused.headers
            tail = list(lines)
        assert finish_reason(head + tail) == "length"
        assert wait_exit(router) == 0
    finally:
        cluster.stop()


def test_sigterm_drains_a_hybrid_node(model: str, tmp_path: Path) -> None:
    args = ["--engine", "fake", "--model", model, "--served-model-name", MODEL, "--no-warmup"]
    hybrid = start_node("hybrid", tmp_path, args)
    try:
        hybrid.wait_healthy(STARTUP_TIMEOUT_S)
        assert status(f"{hybrid.url}/health/ready") == 200
        with open_stream(hybrid.url, "a long story") as lines:
            head = [next(lines) for _ in range(3)]
            hybrid.process.terminate()
            wait_until(lambda: status(f"{hybrid.url}/health/ready") == 503, 10)
            assert status(f"{hybrid.url}/health/live") == 200
            tail = list(lines)
        assert finish_reason(head + tail) == "length"
        assert wait_exit(hybrid) == 0
    finally:
        hybrid.stop()


# -- the quick start ----------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_sigterm_on_the_quick_start_stops_every_node(tiny_model_path: Path,
                                                     tmp_path: Path) -> None:
    quickstart = subprocess.Popen(
        [sys.executable, "-m", "mlxcel_plugin.quickstart", "--model", str(tiny_model_path),
         "--port", str(free_port()), "--workdir", str(tmp_path), "--max-tokens", "4",
         "--serve"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    nodes: list[int] = []
    try:
        for line in quickstart.stdout:  # until the cluster serves (or the process ends)
            if line.startswith("serving at"):
                break
        nodes = children_of(quickstart.pid)
        assert len(nodes) == 3
        quickstart.terminate()
        assert quickstart.wait(timeout=EXIT_DEADLINE_S + 20) == 0
        assert [pid for pid in nodes if alive(pid)] == []
    finally:
        for pid in nodes:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if quickstart.poll() is None:
            quickstart.kill()
            quickstart.wait(10)
