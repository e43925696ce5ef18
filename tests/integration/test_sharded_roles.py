"""Sharded nodes as users start them: beside unsharded ones, and ranks from a hostfile.

A prefill node sharded over 2 local ranks hands off to an unsharded decode
node, and an unsharded prefill node to a sharded decode node.

Real processes (``--shard-ranks 2``: rank 1 is the node's child), compared with
an unsharded hybrid node's answers: the handoff carries whole K/V (gathered
from both ranks, or split between them on arrival), so neither side needs to
know of the other's split. The
tiny llama keeps greedy tokens clear of ties, so the text is the same (what
exactly is guaranteed: tests/engines/sharding/test_ranks.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LOOPBACK, free_port, start_node
from mlxcel_plugin.shard_ranks import write_loopback_hostfile

pytestmark = pytest.mark.timeout(600)
STARTUP_TIMEOUT_S = 180
MODEL = "tiny"
PROMPT = "the fox ran over the hill and far away"
CASES = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 3,
                         "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": 12}),
]


def answers(url: str) -> list[str]:
    """Each case's text (a stream's deltas joined) and finish reason."""
    out = []
    with httpx.Client(timeout=120) as http:
        for path, body in CASES:
            response = http.post(f"{url}{path}", json={"model": MODEL, **body})
            assert response.status_code == 200, response.text
            out.append(_text(response.text))
    return out


def _text(body: str) -> str:
    chunks = [json.loads(line[6:]) for line in body.splitlines()
              if line.startswith("data: {")] or [json.loads(body)]
    parts, finish = [], None
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            parts.append(choice.get("text") or (choice.get("message") or {}).get("content")
                         or (choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return f"{''.join(parts)!r} ({finish})"


def handoffs(url: str, want: int, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("mlxcel:handoff_bytes_count ")]
        count = float(lines[0].split()[-1]) if lines else 0.0
        if count >= want or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


def followers_of(pid: int) -> list[int]:
    """Processes started as shard followers of ``pid`` (their ``--parent-pid``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engines.sharding.follower" in argv and str(pid).encode() in argv:
            found.append(int(entry.name))
    return found


def node_args(model_path: Path) -> list[str]:
    return ["--model", str(model_path), "--served-model-name", MODEL, "--no-warmup"]


@pytest.fixture(scope="module")
def expected(tiny_model_path, tmp_path_factory) -> list[str]:
    """An unsharded hybrid node's answers."""
    hybrid = start_node("hybrid", tmp_path_factory.mktemp("hybrid"), node_args(tiny_model_path))
    try:
        hybrid.wait_healthy(STARTUP_TIMEOUT_S)
        return answers(hybrid.url)
    finally:
        hybrid.stop()


@pytest.mark.parametrize("sharded", ["prefill", "decode"])
def test_a_sharded_node_hands_off_with_an_unsharded_one(sharded: str, expected: list[str],
                                                       tiny_model_path, tmp_path: Path):
    secret = tmp_path / "cluster.secret"
    generate_secret_file(secret)
    toml = tmp_path / "cluster.toml"
    toml.write_text("[prefix_cache]\nlocal_prefill_tokens = 0\n")  # every request hands off
    args = [*node_args(tiny_model_path), "--cluster-secret-file", str(secret),
            "--distributed-config", str(toml)]
    binds = {role: f"{LOOPBACK}:{free_port()}" for role in ("prefill", "decode")}
    roles = {role: start_node(role, tmp_path, [*args, *(["--shard-ranks", "2"]
                                                        if role == sharded else [])],
                              serving_bind=binds[role])
             for role in ("prefill", "decode")}
    router = start_node("router", tmp_path, [*args, "--prefill-peers", binds["prefill"],
                                             "--decode-peers", binds["decode"]])
    nodes = [router, roles["decode"], roles["prefill"]]
    try:
        for node in nodes:
            node.wait_healthy(STARTUP_TIMEOUT_S)
        ranks = followers_of(roles[sharded].process.pid)
        routed = answers(router.url)
        handed_off = handoffs(roles["prefill"].url, len(CASES))
    finally:
        statuses = [node.stop() for node in nodes]
    assert len(ranks) == 1, roles[sharded].log_tail()
    assert routed == expected
    assert handed_off == len(CASES)
    assert statuses == [0, 0, 0], [node.log_tail() for node in nodes]
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]  # no rank left behind
    ring = re.search(r"local ranks \(ring (\S+)\)", roles[sharded].log_path.read_text())
    assert ring and not Path(ring.group(1)).parent.exists()  # nor its hostfile's directory


def test_ranks_from_a_hostfile_and_a_lost_rank_ends_the_node(tiny_model_path, tmp_path: Path):
    """The multi-host form on loopback: each rank is ``mlxcel-server`` with its ``--shard-rank``."""
    hostfile = write_loopback_hostfile(2, tmp_path)
    args = [*node_args(tiny_model_path), "--shard-hostfile", str(hostfile)]
    rank1 = start_node("hybrid", tmp_path, [*args, "--shard-rank", "1"], name="rank1")
    node = start_node("hybrid", tmp_path, [*args, "--shard-rank", "0"])
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        assert len(answers(node.url)) == len(CASES)  # served across both ranks
        rank1.process.kill()
        rank1.process.wait()
        with contextlib.suppress(httpx.HTTPError):  # the engine finds the ring broken
            httpx.post(f"{node.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        status = node.wait_stopped(timeout_s=60)
    finally:
        node.stop()
        rank1.stop()
    assert status == 1, node.log_tail()
    assert "shard ring broken" in node.log_tail(50)
