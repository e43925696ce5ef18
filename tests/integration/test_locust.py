"""Locust, headless, against a real hybrid node and a real router cluster (tiny checkpoint).

The locustfile times every streamed request itself (TTFT, ITL, TPOT, E2E,
tokens/s as ``METRIC`` rows); this test checks that a short run produces those
rows with sane values and no failed request.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.request import urlopen

import httpx
import pytest

from mlxcel_plugin.local_cluster import LocalCluster, NodeProcess, start_node

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = REPO / "loadtests" / "locustfile.py"
# loadtests/ is scripts, not a package: import its parser the way locust does.
sys.path.insert(0, str(LOCUSTFILE.parent))
from bench_common import StreamRecorder  # noqa: E402

METRIC_ROWS = ("TTFT", "ITL", "TPOT", "E2E", "tokens_per_s")
RUN_TIME_S = 4  # 4 users for 4 s on the tiny model fill every METRIC row
NODE_START_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def hybrid_node(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    workdir = tmp_path_factory.mktemp("locust-hybrid")
    node = start_node("hybrid", workdir, ["--model", str(tiny_model_path)])
    try:
        # wait_healthy raises with the node's log tail: a server that cannot start fails here.
        node.wait_healthy(NODE_START_TIMEOUT_S)
        yield node
    finally:
        node.stop()


def run_locust(host: str, csv_prefix: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless"]
    argv += ["-u", "4", "-r", "4", "-t", f"{RUN_TIME_S}s", "--host", host]
    # --stop-timeout lets in-flight streams finish instead of being cut off at the end.
    argv += ["--csv", str(csv_prefix), "--stop-timeout", "20", "--only-summary"]
    env = {**os.environ, "MLXCEL_LOCUST_MAX_TOKENS": "16", "MLXCEL_LOCUST_SEED": "1"}
    return subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIME_S + 60
    )


def read_stats(csv_prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(f"{csv_prefix}_stats.csv", newline="") as handle:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(handle)}


def assert_healthy_run(done: subprocess.CompletedProcess[str], prefix: Path) -> None:
    """Requests went through, none failed, every METRIC row is there with a positive value."""
    output = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"locust exited {done.returncode}:\n{output}"
    stats = read_stats(prefix)

    posts = [row for (kind, _), row in stats.items() if kind == "POST"]
    assert sum(int(row["Request Count"]) for row in posts) > 0, output
    failures = Path(f"{prefix}_failures.csv").read_text()
    assert all(row["Failure Count"] == "0" for row in stats.values()), failures

    for name in METRIC_ROWS:
        row = stats.get(("METRIC", name))
        assert row is not None, f"no METRIC {name} row:\n{output}"
        assert int(row["Request Count"]) > 0, row
        assert float(row["Average Response Time"]) > 0, row
    # A 4-user run on a tiny model answers within seconds, never minutes.
    assert float(stats[("METRIC", "TTFT")]["Median Response Time"]) < 30_000


def assert_still_serving(url: str) -> None:
    """After the run, a fresh request is answered: the run left the server whole (a decode
    step that killed the engine thread once left every stream hanging while locust's stop
    timeout hid it)."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": model, "prompt": "After the run", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, \
        reply.text


def test_locust_streams_against_hybrid(hybrid_node: NodeProcess, tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    assert_healthy_run(run_locust(hybrid_node.url, prefix), prefix)
    assert_still_serving(hybrid_node.url)


def test_locust_streams_against_a_router_cluster(tiny_model_path: Path, tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", model=str(tiny_model_path))
    with cluster:
        prefix = tmp_path / "run"
        assert_healthy_run(run_locust(cluster.router.url, prefix), prefix)
        assert_still_serving(cluster.router.url)
        stats = json.loads(urlopen(f"{cluster.router.url}/router/stats", timeout=10).read())
    assert stats["metrics"]["completed"] > 0 and stats["metrics"]["failed"] == 0


def _feed(lines: list[str]) -> StreamRecorder:
    recorder = StreamRecorder(kind="chat")
    for step, line in enumerate(lines):
        recorder.feed(line, now_s=0.1 * (step + 1))
    return recorder


def _chunk(content: str | None = None, finish: str | None = None) -> str:
    delta = {"content": content} if content is not None else {"role": "assistant"}
    return "data: " + json.dumps({"choices": [{"delta": delta, "finish_reason": finish}]})


def test_stream_recorder_times_content_chunks_and_prefers_usage() -> None:
    usage = 'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}'
    lines = [_chunk(), _chunk("Hel"), "", _chunk("lo"), _chunk("!", "stop"), usage, "data: [DONE]"]
    result = _feed(lines).finish(e2e_s=0.8)
    assert result.ok and result.finish_reason == "stop"
    assert result.ttft_s == pytest.approx(0.2)  # the role-only chunk is not a token
    assert result.itl_s == pytest.approx([0.2, 0.1])
    assert (result.completion_tokens, result.prompt_tokens) == (3, 7)
    assert result.tpot_s == pytest.approx((0.8 - 0.2) / 2)


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ([_chunk("a", "stop")], "stream ended without [DONE]"),
        ([_chunk("a"), "data: [DONE]"], "stream had no finish_reason"),
        (["data: {not json"], "malformed SSE data"),
        (['data: {"error": {"message": "boom"}}'], "error event"),
        ([_chunk("a", "stop"), "data: [DONE]", _chunk("b")], "data after [DONE]"),
    ],
)
def test_stream_recorder_names_malformed_streams(lines: list[str], error: str) -> None:
    result = _feed(lines).finish(e2e_s=1.0)
    assert not result.ok
    assert result.error is not None and result.error.startswith(error)
