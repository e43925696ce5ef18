"""``--shard-*`` flags: validation, the loopback ring hostfile, and what rank 0 exports.

Starting real ranks is tests/integration/test_sharded_roles.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_plugin import shard_ranks
from mlxcel_plugin.config import build_config
from mlxcel_plugin.errors import ConfigError


def config(env: dict[str, str] | None = None, **flags):
    return build_config(flags, env=env or {})


def test_unsharded_by_default():
    built = config()
    assert (built.shard_ranks, built.shard_hostfile, built.shard_rank) == (1, None, 0)


@pytest.mark.parametrize(("flags", "message"), [
    ({"shard_ranks": 0}, "must be >= 1"),
    ({"shard_ranks": 2, "role": "router", "peers": "a:1"}, "router holds no model"),
    ({"shard_hostfile": "/nonexistent/hosts.json"}, "no such file"),
    ({"shard_rank": 1}, "needs --shard-hostfile"),
])
def test_bad_shard_flags_fail_at_startup(flags: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        config(**flags)


def test_local_ranks_and_a_hostfile_go_apart(tmp_path: Path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text("[]")
    with pytest.raises(ConfigError, match="go apart"):
        config(shard_ranks=2, shard_hostfile=str(hosts))


def test_mlx_launch_s_variables_name_the_ring(tmp_path: Path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text("[]")
    built = config({"MLX_HOSTFILE": str(hosts), "MLX_RANK": "1"})
    assert (built.shard_hostfile, built.shard_rank) == (str(hosts), 1)


def test_the_loopback_hostfile_has_one_port_per_rank(tmp_path: Path):
    ring = json.loads(shard_ranks.write_loopback_hostfile(3, tmp_path).read_text())
    assert len(ring) == 3 and all(len(rank) == 1 for rank in ring)
    assert all(rank[0].startswith("127.0.0.1:") for rank in ring)
    assert len({rank[0] for rank in ring}) == 3


def test_rank_0_of_a_hostfile_serves_with_the_ring_in_its_env(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    hosts = tmp_path / "hosts.json"
    hosts.write_text("[]")
    # prepare_ranks writes os.environ: give it a copy, so no later test in this process
    # finds a ring hostfile (the engine would then join a ring of none).
    ring_free = {k: v for k, v in os.environ.items() if k not in ("MLX_HOSTFILE", "MLX_RANK")}
    monkeypatch.setattr(os, "environ", ring_free)
    shard_ranks.prepare_ranks(config(shard_hostfile=str(hosts), model=str(tmp_path)))
    assert os.environ["MLX_HOSTFILE"] == str(hosts) and os.environ["MLX_RANK"] == "0"


def test_an_unsharded_node_leaves_the_env_alone(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    shard_ranks.prepare_ranks(config())
    assert "MLX_HOSTFILE" not in os.environ


def test_a_follower_runs_the_engine_side_module():
    argv = shard_ranks.follower_argv("/models/m", parent_pid=42)
    assert argv == [sys.executable, "-m", "engines.sharding.follower", "--model", "/models/m",
                    "--parent-pid", "42"]


@pytest.mark.parametrize(("status", "exits"), [(3, [1]), (0, [])])
def test_a_local_rank_that_fails_ends_the_node(status: int, exits: list[int],
                                               monkeypatch: pytest.MonkeyPatch):
    codes: list[int] = []
    monkeypatch.setattr(shard_ranks.os, "_exit", codes.append)
    rank = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({status})"])
    for watcher in shard_ranks.exit_when_any_fails([rank]):
        watcher.join()
    assert codes == exits  # a rank exits 0 only after the leader's STOP: that is no failure
