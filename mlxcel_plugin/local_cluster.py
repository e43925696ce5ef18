"""Start a router + prefill + decode cluster (or one hybrid node) on 127.0.0.1.

Used by the quick start, the integration tests and the benchmarks: real
processes, real sockets, stopped by PID. Each node runs in its own process
group, so a terminal's Ctrl-C reaches only the parent, which stops the nodes
itself: SIGTERM to each (they drain: in-flight requests finish), then waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.node_forkserver import ForkedNode, NodeForkserver

LOOPBACK = "127.0.0.1"
# A node gets this long to drain after SIGTERM before SIGKILL: its default
# [node] drain_timeout_s (30 s) plus time to close.
STOP_TIMEOUT_S = 40.0


# Below the kernels' ephemeral ranges (Linux 32768+, macOS 49152+): between our pick and the
# node's bind, no ephemeral port the kernel hands out (a bulk listener's, an outgoing
# connection's local end) can be the one we picked.
_PICK_PORTS = range(20000, 32768)
_PICK_ATTEMPTS = 64
# Every port this process handed out: a port is free again the moment free_port's probe
# socket closes, so without this two nodes of one cluster could be given the same port
# and the second would fail to bind (EADDRINUSE) at start-up.
_handed_out: set[int] = set()


def _pick_ports() -> range:
    """``_PICK_PORTS`` less whatever this host's kernel uses as ephemeral ports (Linux)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return _PICK_PORTS
    if low >= _PICK_PORTS.stop or high < _PICK_PORTS.start:
        return _PICK_PORTS
    below, above = range(_PICK_PORTS.start, low), range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def _worker_share(ports: range) -> range:
    """Under pytest-xdist, this worker's own slice of ``ports`` (every Nth from its index).

    ``_handed_out`` is per process: two workers could pick the same port for nodes starting
    side by side. Their environment (inherited by the nodes they start) names the worker.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count < 2:
        return ports
    return ports[int(worker[2:]) % count::count] or ports  # a range too small to share


# Set by fork_nodes(): later nodes of this process are forked from a forkserver.
_forkserver: NodeForkserver | None = None


def fork_nodes() -> None:
    """Fork later nodes from a forkserver that imported their libraries once (the suite's
    ~300 node starts: mlxcel_plugin/node_forkserver.py); the default spawns each one."""
    global _forkserver
    _forkserver = _forkserver or NodeForkserver()


def free_port() -> int:
    """A loopback port free now and never handed out before, for a node started next to bind."""
    ports = _worker_share(_pick_ports())
    for _ in range(_PICK_ATTEMPTS):  # bounded: a few ports in the range are ever taken
        port = random.choice(ports)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    for _ in range(_PICK_ATTEMPTS):  # that range is busy here: let the kernel pick
        with socket.socket() as sock:
            sock.bind((LOOPBACK, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {LOOPBACK} after {2 * _PICK_ATTEMPTS} tries")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def http_get_json(url: str, timeout_s: float = 2.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


@dataclass
class NodeProcess:
    role: str
    port: int
    serving_bind: str | None
    log_path: Path
    process: subprocess.Popen | ForkedNode
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def is_healthy(self) -> bool:
        try:
            return http_get_json(f"{self.url}/health").get("status") == "ok"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.role} node exited: {self.log_tail()}")
            if self.is_healthy():
                return
            time.sleep(0.05)  # the suite waits for ~280 starts: a poll costs far less
        raise TimeoutError(f"{self.role} node not healthy after {timeout_s}s: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def terminate(self) -> None:
        """SIGTERM: the node drains, then exits. SIGCONT too, so a stopped node hears it."""
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(self.process.pid, signal.SIGCONT)

    def wait_stopped(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Wait for the exit (SIGKILL after ``timeout_s``); returns the exit status."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        self.terminate()
        return self.wait_stopped(timeout_s)


def pin_process(pid: int, cores: Collection[int]) -> bool:
    """Restrict ``pid`` and every thread it has so far to ``cores``; False where unsupported.

    Linux only. Threads inherit the affinity of the thread that creates them, so
    pinning each existing thread right after spawn covers the threads still to come.
    """
    if not cores or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return False  # already gone (or no /proc): nothing left to pin
    for tid in tids:
        try:
            os.sched_setaffinity(tid, set(cores))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
    return True


def start_node(
    role: str,
    workdir: Path,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    port: int | None = None,
    serving_bind: str | None = None,
    name: str | None = None,
    cpu_affinity: Collection[int] | None = None,
) -> NodeProcess:
    """Spawn one node; ``cpu_affinity`` pins it to those cores (Linux; ignored elsewhere)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "mlxcel_plugin.cli", "--node-role", role, "--port", str(port)]
    if serving_bind:
        argv += ["--serving-bind", serving_bind]
    argv += args
    log_path = workdir / f"{name or role}-{port}.log"
    process = _spawn(argv, {**os.environ, **(env or {})}, log_path)
    if cpu_affinity:
        pin_process(process.pid, cpu_affinity)
    return NodeProcess(role, port, serving_bind, log_path, process, argv)


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen | ForkedNode:
    if _forkserver is not None and _forkserver.can_fork(env):
        return _forkserver.start(argv[3:], env, log_path)  # argv[3:]: the CLI's own arguments
    with open(log_path, "ab") as log:  # the child keeps its own descriptor of it
        # Its own process group: a terminal's SIGINT goes to the parent only, which forwards it.
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                process_group=0)


@dataclass
class LocalCluster:
    """``prefill_count`` prefill + ``decode_count`` decode nodes behind one router."""

    workdir: Path
    model: str | None = None
    prefill_count: int = 1
    decode_count: int = 1
    router_port: int | None = None
    common_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    nodes: list[NodeProcess] = field(default_factory=list)

    @property
    def secret_path(self) -> Path:
        return self.workdir / "cluster.secret"

    @property
    def router(self) -> NodeProcess:
        return next(node for node in self.nodes if node.role == "router")

    def pool(self, role: str) -> list[NodeProcess]:
        return [node for node in self.nodes if node.role == role]

    def node_args(self) -> list[str]:
        args = ["--cluster-secret-file", str(self.secret_path), *self.common_args]
        return args + (["--model", self.model] if self.model else [])

    def start_engine_node(self, role: str, serving_bind: str | None = None) -> NodeProcess:
        bind = serving_bind or f"{LOOPBACK}:{free_port()}"
        node = start_node(role, self.workdir, self.node_args(), env=self.env, serving_bind=bind)
        self.nodes.append(node)
        return node

    def start(self, timeout_s: float = 300.0) -> LocalCluster:
        return self.launch().wait_healthy(timeout_s)

    def launch(self) -> LocalCluster:
        """Spawn every node without waiting, so other nodes can start side by side with them."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.secret_path.exists():
            generate_secret_file(self.secret_path)
        for _ in range(self.prefill_count):
            self.start_engine_node("prefill")
        for _ in range(self.decode_count):
            self.start_engine_node("decode")
        peers = [
            "--prefill-peers",
            ",".join(n.serving_bind for n in self.pool("prefill")),
            "--decode-peers",
            ",".join(n.serving_bind for n in self.pool("decode")),
        ]
        router_args = [*self.node_args(), *peers, *self.router_args]
        router = start_node(
            "router", self.workdir, router_args, env=self.env, port=self.router_port
        )
        self.nodes.append(router)
        return self

    def wait_healthy(self, timeout_s: float = 300.0) -> LocalCluster:
        """Every node healthy, or all of them stopped and the first failure raised."""
        try:
            for node in self.nodes:
                node.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to every node at once (they drain side by side), then wait for each."""
        for node in reversed(self.nodes):
            node.terminate()
        for node in reversed(self.nodes):
            node.wait_stopped(timeout_s)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
