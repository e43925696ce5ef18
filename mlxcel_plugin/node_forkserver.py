"""Start nodes forked from a process that has already imported their heavy libraries.

A node started as ``python -m mlxcel_plugin.cli`` spends about two of its three
CPU-seconds of start-up importing transformers, mlx-lm, MLX and FastAPI (then
re-executing itself with OpenBLAS preloaded). The test suite starts a few
hundred nodes, so it forks them instead from one of multiprocessing's
forkservers per test process, which imported those libraries once with the
OpenBLAS preload in place (and this project's role modules, which read no
setting at import): each node still runs the ``mlxcel_plugin.cli`` module, as
``python -m`` would, in its own process, with its own environment, working
directory, process group and log file, and reads its settings there. A start whose
environment differs where those libraries read it at import (the preload, the
interpreter's, OpenBLAS's, Hugging Face's, MLX's variables) falls back to
``subprocess``.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from mlxcel_plugin import openblas

PRELOAD = (
    "numpy", "mlx.core", "mlx.nn", "mlx_lm.utils", "mlx_lm.models.cache",
    "mlx_lm.tokenizer_utils", "transformers", "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_fast", "tokenizers", "fastapi", "starlette", "uvicorn",
    "pydantic", "httpx", "websockets", "cryptography.hazmat.primitives.ciphers.aead",
    "msgpack", "lz4.frame", "llguidance", "prometheus_client", "pluggy", "jinja2", "yaml",
    # The project's roles too (~0.35 s more per start): none reads the environment at import
    # (settings are read in main()), and the CLI module itself stays out, run fresh by runpy.
    "mlxcel_plugin.nodes.roles", "router_plugin.roles", "engines.plugin", "engines.mlx_engine",
    "mlxcel_plugin.forkserver_heap",  # last: freezes what the others left out of gc's scans
)
# Read once, when the preloaded libraries are imported: a node that sets one of these
# differently from the forkserver cannot be forked from it.
IMPORT_TIME_PREFIXES = ("LD_", "PYTHON", "OPENBLAS_", "MLXCEL_NO_OPENBLAS",
                        "MLXCEL_OPENBLAS_CORETYPE", "HF_", "HUGGINGFACE_", "TRANSFORMERS_",
                        "TOKENIZERS_", "MLX_", "OMP_")
# What the CLI sets before importing transformers (mlxcel_plugin/text/tokenizer.py).
NODE_DEFAULTS = {"TRANSFORMERS_VERBOSITY": "error"}


class NodeWaitTimeout(subprocess.TimeoutExpired):
    """``wait`` timed out: says where the node and the forkserver (its parent, which reports
    its exit) stand, so a node that was killed yet never reported ended can be told apart
    from one still running."""

    def __init__(self, args: list[str], timeout: float, pid: int) -> None:
        super().__init__(args, timeout)
        self.states = f"node {_process_state(pid)}; forkserver {_process_state(_forkserver_pid())}"

    def __str__(self) -> str:
        return f"{super().__str__()} ({self.states})"


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def process_state(pid: int) -> str | None:
    """``pid``'s state letter from ``/proc`` (``R``, ``S``, ``Z`` ...); None once it is gone
    (reaped) or where there is no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]  # after the command name, which may hold ")"


def _process_state(pid: int | None) -> str:
    """``pid``'s state letter and kernel wait channel (Linux), e.g. ``123 S do_select``."""
    if pid is None:
        return "not running"
    state = process_state(pid)
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        state = None
    return f"{pid} gone" if state is None else f"{pid} {state} {wchan or '-'}"


class ForkedNode:
    """The part of ``subprocess.Popen``'s interface the node helpers use, for a forked node."""

    def __init__(self, process: multiprocessing.process.BaseProcess, argv: list[str]) -> None:
        self._process = process
        self.pid: int = process.pid
        self.args = argv

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise NodeWaitTimeout(self.args, timeout or 0, self.pid)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """As ``Popen.send_signal``: a node already gone is left alone. Its exit status comes
        from the forkserver (its parent) over a pipe, so it can be gone before poll() says."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class NodeForkserver:
    """One forkserver for this process's node starts (started at the first one)."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._server_env: dict[str, str] | None = None

    def can_fork(self, env: Mapping[str, str]) -> bool:
        """Whether a node with ``env`` would import its libraries as the forkserver did."""
        server = self._server_env if self._server_env is not None else _server_env(os.environ)
        return _import_time(_server_env(env)) == _import_time(server)

    def start(self, argv: list[str], env: Mapping[str, str], log_path: Path) -> ForkedNode:
        self._ensure_running()
        process = self._context.Process(
            target=run_node, args=(argv, _server_env(env), os.getcwd(), str(log_path)),
            name=f"node-{log_path.stem}", daemon=False,
        )
        process.start()
        return ForkedNode(process, argv)

    def _ensure_running(self) -> None:
        if self._server_env is not None:
            return
        self._server_env = _server_env(os.environ)
        self._context.set_forkserver_preload(list(PRELOAD))
        saved = dict(os.environ)
        os.environ.update(self._server_env)  # the forkserver inherits this environment
        try:
            from multiprocessing import forkserver
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)


def run_node(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: become a node process, as ``start_node`` would have spawned it."""
    os.setpgid(0, 0)  # its own process group: a terminal's Ctrl-C reaches the parent only
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [sys.executable, *argv]  # runpy puts the module's path first, as -m does
    try:
        runpy.run_module("mlxcel_plugin.cli", run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit


def _server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` as an engine node runs with it: after its OpenBLAS re-exec (cli.py)."""
    env = {**NODE_DEFAULTS, **environ}
    return openblas.preload_env(env) or env


def _import_time(env: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(IMPORT_TIME_PREFIXES)}
