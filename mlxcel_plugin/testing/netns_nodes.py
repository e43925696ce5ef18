"""mlxcel nodes started inside the hosts of a ``NetnsTopology``.

Each node binds its ops endpoint and its link listener to its host's address
(never 0.0.0.0 or loopback), so this process reaches it over the bridge like a
peer on another machine would. Every host has its own port space: the ports are
fixed, and several nodes on one host take ``serving_port`` + n.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel_plugin.link import ClusterSecret, generate_secret_file, load_cluster_secret
from mlxcel_plugin.local_cluster import NodeProcess
from mlxcel_plugin.testing.netns import NetnsTopology

HTTP_PORT = 8000
SERVING_PORT = 9000
LINK_ROLES = ("prefill", "decode")  # roles with a link listener (--serving-bind)


@dataclass
class NetnsNode(NodeProcess):
    host: str = ""  # the topology's host name
    address: str = ""  # that host's address, which the node binds

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"


@dataclass
class NetnsNodes:
    """Nodes on ``net``'s hosts sharing one cluster secret; ``stop_all`` in reverse order."""

    net: NetnsTopology
    workdir: Path
    started: list[NetnsNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.secret_path = self.workdir / "cluster.secret"
        if not self.secret_path.exists():
            generate_secret_file(self.secret_path)
        self.secret: ClusterSecret = load_cluster_secret(str(self.secret_path), {})

    def start(self, host: str, role: str, name: str, args: list[str], toml: str = "", *,
              env: dict[str, str] | None = None, http_port: int | None = None,
              serving_port: int | None = None) -> NetnsNode:
        """One node on ``host``; ports default to the first free pair on that host."""
        on_host = sum(node.host == host for node in self.started)
        http_port = http_port or HTTP_PORT + on_host
        address = self.net.address(host)
        argv = [sys.executable, "-m", "mlxcel_plugin.cli", "--node-role", role,
                "--host", address, "--port", str(http_port), "--node-id", name,
                "--cluster-secret-file", str(self.secret_path)]
        bind = None
        if role in LINK_ROLES:
            bind = f"{address}:{serving_port or SERVING_PORT + on_host}"
            argv += ["--serving-bind", bind]
        if toml:
            config = self.workdir / f"{name}.toml"
            config.write_text(toml)
            argv += ["--distributed-config", str(config)]
        log_path = self.workdir / f"{name}.log"
        process = self.net.spawn(host, [*argv, *args], log_path, env)
        node = NetnsNode(role, http_port, bind, log_path, process, argv, host, address)
        self.started.append(node)
        return node

    def wait_all(self, timeout_s: float = 120.0) -> None:
        for node in self.started:
            node.wait_healthy(timeout_s)

    def stop_all(self) -> None:
        for node in reversed(self.started):
            node.stop()
