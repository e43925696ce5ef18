"""Two ranks on this machine: a tensor-parallel engine against the unsharded one.

Rank 0 (``tests/engines/sharding_child.py``) runs both engines on the tiny
llama (2 KV heads: one per rank); rank 1 is ``engines.sharding.follower``.

What is guaranteed: a split matmul all-reduces partial sums, so the sharded
forward rounds differently from the unsharded one (K/V within ~1e-6 here);
greedy and seeded tokens are the same wherever no two logits are that close.
On these prompts (the tiny model's head keeps greedy tokens far from ties)
every token matches, and the run is deterministic, so the test asserts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxcel_plugin import openblas
from mlxcel_plugin.shard_ranks import follower_argv, write_loopback_hostfile

pytestmark = pytest.mark.timeout(300)
RUN_TIMEOUT_S = 240
# Float rounding of the split matmuls, with ample room: a lost or misplaced head is ~1.
KV_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def ranks_run(tiny_model_path, tmp_path_factory) -> tuple[dict, int]:
    hostfile = write_loopback_hostfile(2, tmp_path_factory.mktemp("ring"))
    env = openblas.preload_env(os.environ) or dict(os.environ)
    env["MLX_HOSTFILE"] = str(hostfile)
    follower = subprocess.Popen(follower_argv(str(tiny_model_path)),
                                env={**env, "MLX_RANK": "1"})
    try:
        leader = subprocess.run(
            [sys.executable, "-m", "tests.engines.sharding_child", str(tiny_model_path)],
            env={**env, "MLX_RANK": "0"}, capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S, check=False)
        assert leader.returncode == 0, leader.stderr[-3000:]
        status = follower.wait(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    return json.loads(leader.stdout.strip().splitlines()[-1]), status


def test_the_sharded_node_looks_like_the_whole_model(ranks_run):
    out, _ = ranks_run
    assert out["ranks"] == 2 and out["fingerprint_equal"]


@pytest.mark.parametrize("run", ["sharded", "sharded_batched", "sharded_to_plain",
                                 "plain_to_sharded"])
def test_tokens_are_the_unsharded_engine_s(ranks_run, run: str):
    out, _ = ranks_run
    assert all(len(tokens) == 24 for tokens in out["plain"])
    assert out[run] == out["plain"]


def test_a_failing_consumer_and_a_cancel_keep_the_ranks_in_step(ranks_run):
    out, _ = ranks_run
    after, (reason,) = out["in_step_after_cancels"]
    assert reason == "cancelled"
    assert after == out["plain"][2]  # a forward out of step would garble or hang this


def test_a_follower_proposes_what_the_leader_does_with_a_learned_row_cost(ranks_run):
    """Rank 0's timed forwards say a row costs 4 one-row forwards (rank 1's own would not):
    with prompt lookup on, both ranks still feed the same forwards, so the greedy tokens are
    the unsharded engine's and the ranks stay in step for the next request."""
    out, _ = ranks_run
    spec = out["speculating"]
    assert spec["proposed"] > 0
    assert spec["leader_row_cost"] == 4.0, spec["leader_samples"]
    assert all(len(tokens) == 24 for tokens in spec["plain"])
    assert spec["learning"] == spec["plain"]
    assert spec["alone"] == spec["plain"]
    assert spec["together"] == spec["plain"]
    assert out["after_speculating"] == out["plain"][0]


def test_gathered_kv_differs_only_by_rounding(ranks_run):
    out, _ = ranks_run
    assert out["kv_max_abs_gap"] < KV_TOLERANCE


def test_the_follower_exits_cleanly_when_the_leader_closes(ranks_run):
    _, status = ranks_run
    assert status == 0
