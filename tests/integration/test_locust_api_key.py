"""The locustfile sends ``MLXCEL_API_KEY`` (the server's ``--api-key``) as a Bearer token."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def auth_header(env: dict[str, str]) -> str:
    # A child process: importing locust monkey-patches the standard library (gevent).
    code = "import sys; sys.path.insert(0, 'loadtests'); import locustfile; print(locustfile.AUTH)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120, check=True)  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def test_locustfile_passes_the_key_when_configured() -> None:
    assert auth_header({"MLXCEL_API_KEY": "sk-a,sk-b"}) == "{'Authorization': 'Bearer sk-a'}"
    assert auth_header({"MLXCEL_API_KEY": ""}) == "{}"
