"""The CLI's contract: one-line errors on bad input, and the README's main job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_plugin.local_cluster import free_port

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean_env = {"PATH": "/usr/bin:/bin", "HOME": str(REPO / ".cache"), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mlxcel_plugin.cli", *args],
        capture_output=True, text=True, timeout=120, env=clean_env, cwd=REPO,
    )  # fmt: skip


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("mlxcel-server: error: ")
    return lines[0]


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_engine_and_router_roles_refuse_to_start_without_a_secret(role):
    args = ["--node-role", role, "--serving-bind", "127.0.0.1:1"]
    if role == "router":
        args += ["--prefill-peers", "127.0.0.1:2", "--decode-peers", "127.0.0.1:3"]
    line = one_line_error(run_cli(*args))
    assert "needs a cluster secret" in line
    assert "openssl rand -hex 32 > cluster.secret" in line


def test_short_secret_is_refused_without_echoing_it(tmp_path):
    secret = tmp_path / "cluster.secret"
    secret.write_text("abcdef0123\n")
    args = ["--node-role", "decode", "--serving-bind", "127.0.0.1:1"]
    line = one_line_error(run_cli(*args, "--cluster-secret-file", str(secret)))
    assert "needs at least 16" in line
    assert "abcdef0123" not in line


def test_secret_from_env_var_is_accepted_up_to_the_next_check(tmp_path):
    # A good secret passes; the missing model directory is the next (named) error.
    env = {"MLXCEL_CLUSTER_SECRET": "00" * 32}
    args = ["--node-role", "decode", "--serving-bind", "127.0.0.1:1", "--model", "/nope"]
    assert "not a checkpoint directory" in one_line_error(run_cli(*args, env=env))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node-role", "oracle"], "invalid choice"),
        (["--port", "99999"], "--port must be 1..65535"),
        (["--node-role", "prefill"], "needs --serving-bind"),
    ],
)
def test_bad_flags_are_one_line_errors(args, message):
    done = run_cli(*args)
    assert done.returncode == 2
    assert message in done.stderr.strip().splitlines()[-1]


def test_quickstart_answers_through_a_three_process_cluster(tiny_model_path, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mlxcel_plugin.quickstart", "--model", str(tiny_model_path),
         "--port", str(free_port()), "--workdir", str(tmp_path), "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "router + prefill + decode" in out
    for role in ("prefill", "decode", "router"):
        assert f"  {role}" in out
    answer = next(line for line in out.splitlines() if line.startswith("A: "))
    assert len(answer) > len("A: ")
    assert "'completion_tokens': 8" in out
    assert (tmp_path / "cluster.secret").stat().st_mode & 0o077 == 0
