"""Hosts in Linux network namespaces, joined by a bridge, links shaped with ``tc tbf``.

For tests and benchmarks that need a real network between nodes instead of
loopback. Each host is a namespace with one veth (``eth0``) to a bridge that
lives in a namespace of its own (so the host's firewall never sees the bridged
traffic); one more veth gives this process, in the root namespace, an address
on the same subnet to reach the hosts' ops endpoints. Shaping a host's link
puts a ``tbf`` qdisc on both ends of its veth, so it limits what the host sends
and what it receives (``netem`` is missing in the kernels here; ``tbf`` works)::

    with NetnsTopology(("prefill", "decode"), rate_bits_per_s=1e9) as net:
        net.address("decode")                   # "10.213.S.2"
        net.spawn("decode", argv, log_path)     # runs `ip netns exec NS argv`
        net.set_rate("prefill", 10e9)           # tc change, mid-run

Needs root and iproute2 (``ip``, ``tc``); ``unavailable_reason()`` says why
not in one line, for a test to skip with. Every name carries a random tag, so
parallel runs never collide, and teardown removes only what this object made,
also when the body raised.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel_plugin.errors import MlxcelError

SUBNET_PREFIX = "10.213"  # 10.213.S.0/24: a private range these namespaces alone use
ROOT_HOST_OCTET = 254  # this process's address on the subnet
DEVICE = "eth0"  # each host's veth, inside its namespace
BRIDGE = "br0"  # inside the hub namespace
# tbf needs a bucket of at least one GSO packet (64 KiB on veth); 4 ms of the rate
# keeps it from throttling below the rate at 10 Gbit/s.
MIN_BURST_BYTES = 256 * 1024
BURST_S = 0.004
LATENCY_MS = 50
_CMD_TIMEOUT_S = 20.0


class NetnsError(MlxcelError):
    """An ``ip`` or ``tc`` command failed while building or changing a topology."""


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


@functools.cache
def unavailable_reason() -> str | None:
    """None where namespaces and tbf work here, else one line saying why they do not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (install iproute2)"
    probe = f"mlxcel-probe-{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", probe])
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root",
              *tbf_args(1e9)])
    except (NetnsError, subprocess.TimeoutExpired) as exc:
        return f"veth or tc tbf unavailable: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def tbf_args(rate_bits_per_s: float) -> list[str]:
    burst = max(MIN_BURST_BYTES, int(rate_bits_per_s / 8 * BURST_S))
    return ["tbf", "rate", f"{int(rate_bits_per_s)}bit", "burst", str(burst),
            "latency", f"{LATENCY_MS}ms"]


def _used_subnets() -> set[int]:
    text = _run(["ip", "-o", "-4", "addr", "show"]).stdout + _run(["ip", "-4", "route"]).stdout
    return {int(w.split(".")[2]) for w in text.split() if w.startswith(SUBNET_PREFIX + ".")}


def _pick_subnet() -> int:
    used = _used_subnets()
    free = [s for s in range(1, 255) if s not in used]
    if not free:
        raise NetnsError(f"every {SUBNET_PREFIX}.S.0/24 subnet is in use here")
    return free[secrets.randbelow(len(free))]


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    hub_device: str  # its veth's other end, on the bridge


@dataclass
class NetnsTopology:
    """``names`` hosts on one bridge; ``rate_bits_per_s`` shapes every host's link."""

    names: Sequence[str]
    rate_bits_per_s: float | None = None
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: dict[str, Host] = field(default_factory=dict)
    root_address: str = ""
    _namespaces: list[str] = field(default_factory=list)
    _root_device: str | None = None
    _processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"mlxcel-{self.tag}-hub"

    def __enter__(self) -> NetnsTopology:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def exec_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside host ``name`` (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[name].namespace, *argv]

    def spawn(self, name: str, argv: Sequence[str], log_path: Path,
              env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` inside host ``name``, output to ``log_path``; stopped by close()."""
        with open(log_path, "ab") as log:
            process = subprocess.Popen(self.exec_argv(name, argv), stdout=log,
                                       stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})})
        self._processes.append(process)
        return process

    def set_rate(self, name: str, rate_bits_per_s: float | None) -> None:
        """Shape host ``name``'s link both ways (None: unshaped); works mid-transfer."""
        host = self.hosts[name]
        for namespace, device in ((host.namespace, DEVICE), (self.hub, host.hub_device)):
            tc = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
            if rate_bits_per_s is None:
                _run([*tc, "del", "dev", device, "root"], check=False)
            else:
                _run([*tc, "replace", "dev", device, "root", *tbf_args(rate_bits_per_s)])

    def close(self) -> None:
        """Stop what spawn() started and anything left in our namespaces; delete them."""
        for process in self._processes:
            _stop(process)
        for namespace in reversed(self._namespaces):
            for pid in _run(["ip", "netns", "pids", namespace], check=False).stdout.split():
                _kill(int(pid))
        if self._root_device is not None:
            _run(["ip", "link", "del", self._root_device], check=False)
            self._root_device = None
        for namespace in reversed(self._namespaces):
            _run(["ip", "netns", "del", namespace], check=False)
        self._namespaces.clear()

    # -- building ----------------------------------------------------------------------

    def _build(self) -> None:
        subnet = _pick_subnet()
        self._add_namespace(self.hub)
        hub = ["ip", "-n", self.hub, "link"]
        _run([*hub, "add", BRIDGE, "type", "bridge"])
        _run([*hub, "set", BRIDGE, "up"])
        for index, name in enumerate(self.names, start=1):
            self._add_host(name, index, f"{SUBNET_PREFIX}.{subnet}.{index}")
        self._add_root_link(f"{SUBNET_PREFIX}.{subnet}.{ROOT_HOST_OCTET}")
        if self.rate_bits_per_s is not None:
            for name in self.names:
                self.set_rate(name, self.rate_bits_per_s)

    def _add_namespace(self, namespace: str) -> None:
        _run(["ip", "netns", "add", namespace])
        self._namespaces.append(namespace)
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _add_host(self, name: str, index: int, address: str) -> None:
        namespace, hub_device = f"mlxcel-{self.tag}-{name}", f"h{index}"
        self._add_namespace(namespace)
        _run(["ip", "link", "add", DEVICE, "netns", namespace, "type", "veth",
              "peer", "name", hub_device, "netns", self.hub])
        self._attach(hub_device)
        _run(["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", DEVICE])
        _run(["ip", "-n", namespace, "link", "set", DEVICE, "up"])
        self.hosts[name] = Host(name, namespace, address, hub_device)

    def _add_root_link(self, address: str) -> None:
        device = f"mx{self.tag}r"  # the only name outside our namespaces (15 chars at most)
        _run(["ip", "link", "add", device, "type", "veth", "peer", "name", "root",
              "netns", self.hub])
        self._root_device = device
        self._attach("root")
        _run(["ip", "addr", "add", f"{address}/24", "dev", device])
        _run(["ip", "link", "set", device, "up"])
        self.root_address = address

    def _attach(self, hub_device: str) -> None:
        _run(["ip", "-n", self.hub, "link", "set", hub_device, "master", BRIDGE])
        _run(["ip", "-n", self.hub, "link", "set", hub_device, "up"])


def _stop(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return  # ended on its own meanwhile
