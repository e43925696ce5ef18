"""Starting the tensor-parallel ranks of a sharded engine role (``--shard-*`` flags).

* ``--shard-ranks N``: N ranks on this machine. This process is rank 0 (it
  serves the role); ranks 1..N-1 are ``python -m engines.sharding.follower``
  children on a loopback ring hostfile written here. If one of them dies, the
  node exits at once: rank 0 would otherwise wait in its next all-reduce for good.
* ``--shard-hostfile PATH --shard-rank R`` (or ``mlx.launch``'s ``MLX_HOSTFILE``
  and ``MLX_RANK``): one rank of a ring across machines. Rank 0 serves the
  role; any other rank replaces this process with a follower.

The engine finds the ring in ``MLX_HOSTFILE``/``MLX_RANK`` (mlx's own
convention), so this module only sets those; it imports no MLX.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.local_cluster import LOOPBACK, free_port

log = logging.getLogger(__name__)
FOLLOWER_MODULE = "engines.sharding.follower"
HOSTFILE_ENV = "MLX_HOSTFILE"
RANK_ENV = "MLX_RANK"
FOLLOWER_STOP_TIMEOUT_S = 10.0


def write_loopback_hostfile(ranks: int, directory: Path) -> Path:
    """mlx's ring hostfile for ``ranks`` ranks on 127.0.0.1, one free port each."""
    path = directory / "shard-hostfile.json"
    path.write_text(json.dumps([[f"{LOOPBACK}:{free_port()}"] for _ in range(ranks)]))
    return path


def follower_argv(model: str, parent_pid: int | None = None) -> list[str]:
    argv = [sys.executable, "-m", FOLLOWER_MODULE, "--model", model]
    return argv + (["--parent-pid", str(parent_pid)] if parent_pid else [])


_stopping = threading.Event()


def exit_when_any_fails(followers: list[subprocess.Popen]) -> list[threading.Thread]:
    """A follower exits 0 only after the engine's STOP; any other end leaves rank 0 stuck."""

    def watch(follower: subprocess.Popen) -> None:
        code = follower.wait()
        if code != 0 and not _stopping.is_set():
            log.error("shard rank %s exited (status %s); this node cannot go on",
                      follower.args, code)
            os._exit(1)  # the engine thread may be blocked in a collective for good

    watchers = [threading.Thread(target=watch, args=(f,), daemon=True) for f in followers]
    for watcher in watchers:
        watcher.start()
    return watchers


def _stop_followers(followers: list[subprocess.Popen], directory: Path) -> None:
    """At exit: the engine's close sent them STOP; a straggler is killed. Then the ring's
    hostfile goes (its directory is this node's: each start made a new one in /tmp)."""
    _stopping.set()
    for follower in followers:
        try:
            follower.wait(timeout=FOLLOWER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            follower.kill()
            follower.wait()
    shutil.rmtree(directory, ignore_errors=True)


def start_local_ranks(config: ServerConfig) -> list[subprocess.Popen]:
    """Ranks 1..N-1 as children; this process becomes rank 0 (its env names the ring)."""
    directory = Path(tempfile.mkdtemp(prefix="mlxcel-shards-"))
    hostfile = write_loopback_hostfile(config.shard_ranks, directory)
    followers = []
    for rank in range(1, config.shard_ranks):
        env = {**os.environ, HOSTFILE_ENV: str(hostfile), RANK_ENV: str(rank)}
        followers.append(subprocess.Popen(follower_argv(config.model, os.getpid()), env=env))
    os.environ[HOSTFILE_ENV], os.environ[RANK_ENV] = str(hostfile), "0"
    atexit.register(_stop_followers, followers, directory)
    exit_when_any_fails(followers)
    log.info("sharded over %d local ranks (ring %s)", config.shard_ranks, hostfile)
    return followers


def prepare_ranks(config: ServerConfig) -> None:
    """Before the role runs: start local ranks, or become a follower (never returns then)."""
    if config.shard_hostfile:
        os.environ[HOSTFILE_ENV] = config.shard_hostfile
        os.environ[RANK_ENV] = str(config.shard_rank)
        if config.shard_rank != 0:
            argv = follower_argv(config.model)
            os.execv(argv[0], argv)
        return
    if config.shard_ranks > 1:
        start_local_ranks(config)
