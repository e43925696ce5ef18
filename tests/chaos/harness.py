"""A real cluster to break: node processes, a cuttable TCP proxy in front of each, a load.

Every prefill and decode node listens behind a ``LinkProxy`` on 127.0.0.1, and
the router (and the prefill nodes' handoffs) dial the proxy, so a test can cut
a link the way a network does (``cut``: bytes stop flowing, sockets stay open)
as well as ``kill -9`` or ``SIGSTOP`` the process. Streams go through the
router's OpenAI API; ``Outcome`` is what one client saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mlxcel_plugin.link import generate_secret_file
from mlxcel_plugin.local_cluster import LOOPBACK, LocalCluster, NodeProcess, free_port, start_node
from mlxcel_plugin.node_forkserver import process_state

MODEL = "tiny"
STARTUP_TIMEOUT_S = 180
STREAM_DEADLINE_S = 60.0  # no stream may outlive this, whatever the fault


def fake_model_dir(root: Path, tiny: Path, **knobs: object) -> str:
    """The tiny checkpoint's tokenizer and config (no weights) plus fake-engine knobs."""
    root.mkdir(parents=True, exist_ok=True)
    for path in tiny.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, root / path.name)
    (root / "fake_engine.json").write_text(json.dumps(knobs))
    return str(root)


class LinkProxy:
    """A TCP forwarder on its own event loop thread; ``cut`` stalls it like a dead network."""

    def __init__(self, target: str):
        self.target = target
        self.address = f"{LOOPBACK}:{free_port()}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)

    async def _serve(self) -> None:
        host, port = self.address.rsplit(":", 1)
        self._server = await asyncio.start_server(self._on_client, host, int(port))

    async def _on_client(self, reader, writer) -> None:
        host, port = self.target.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                while not self._flowing.is_set():  # a cut: hold the bytes, like a partition
                    await asyncio.sleep(0.05)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass  # the other side went away: this direction ends too
        finally:
            writer.close()

    def cut(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@dataclass
class Outcome:
    """What one streamed completion looked like to its client."""

    text: str = ""
    finish_reason: str | None = None
    errors: list[str] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.done and not self.errors and self.finish_reason in ("length", "stop")


@dataclass
class ChaosCluster:
    """2 prefill + 2 decode nodes, each behind a proxy, and a router; restartable."""

    workdir: Path
    model: str
    common_args: list[str]
    router_toml: str = ""
    prefill_count: int = 2
    decode_count: int = 2
    nodes: dict[str, NodeProcess] = field(default_factory=dict)  # "prefill-0" -> process
    proxies: dict[str, LinkProxy] = field(default_factory=dict)
    router: NodeProcess | None = None

    def __post_init__(self) -> None:
        self.base = LocalCluster(workdir=self.workdir, model=self.model,
                                 common_args=self.common_args)

    def start(self) -> ChaosCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        generate_secret_file(self.base.secret_path)
        for role, count in (("prefill", self.prefill_count), ("decode", self.decode_count)):
            for i in range(count):
                self._start_node(f"{role}-{i}", f"{LOOPBACK}:{free_port()}")
        self.start_router()
        for node in self.nodes.values():
            node.wait_healthy(STARTUP_TIMEOUT_S)
        return self

    def _start_node(self, name: str, bind: str) -> NodeProcess:
        role = name.split("-")[0]
        node = start_node(role, self.workdir, self.base.node_args(), serving_bind=bind, name=name)
        self.nodes[name] = node
        if name not in self.proxies:
            self.proxies[name] = LinkProxy(bind)
        return node

    def start_router(self, port: int | None = None) -> NodeProcess:
        toml = self.workdir / "router.toml"
        toml.write_text(self.router_toml)
        peers = {role: ",".join(self.proxies[n].address for n in sorted(self.proxies)
                                if n.startswith(role)) for role in ("prefill", "decode")}
        args = [*self.base.node_args(), "--prefill-peers", peers["prefill"], "--decode-peers",
                peers["decode"], "--distributed-config", str(toml)]
        self.router = start_node("router", self.workdir, args, port=port,
                                 env={"MLXCEL_ROUTER_STATS_VERBOSE": "1"})
        self.router.wait_healthy(STARTUP_TIMEOUT_S)
        self.wait_until(lambda: self.pool_healthy(self.prefill_count + self.decode_count))
        return self.router

    def restart(self, name: str, exit_timeout_s: float = 0.0) -> NodeProcess:
        """The same node again (same bind behind the same proxy), once the old one is gone.

        ``exit_timeout_s``: how long the old process may take to exit (a drain) before -9.
        """
        old = self.nodes[name]
        try:
            old.process.wait(exit_timeout_s)
        except subprocess.TimeoutExpired:
            old.process.kill()
        try:
            old.process.wait(10)
        except subprocess.TimeoutExpired as late:
            if not _ended(old.process.pid):
                raise
            # Killed and ended (its sockets closed), but its exit not yet reported by its
            # parent (a forked node's: the forkserver): say so, and go on.
            warnings.warn(f"{name} ended but its exit was not reported: {late}", stacklevel=1)
        node = self._start_node(name, old.serving_bind)
        node.wait_healthy(STARTUP_TIMEOUT_S)
        self.wait_until(lambda: self.node_entry(name)["health"] == "healthy")
        return node

    def signal(self, name: str, signum: int) -> None:
        process = self.router.process if name == "router" else self.nodes[name].process
        os.kill(process.pid, signum)

    def stop(self) -> None:
        for node in [*self.nodes.values(), *([self.router] if self.router else [])]:
            if node.process.poll() is None:
                os.kill(node.process.pid, signal.SIGCONT)  # a stopped process cannot exit
            node.stop()
        for proxy in self.proxies.values():
            proxy.close()

    # ------------------------------------------------------------ observing

    def stats(self) -> dict:
        return httpx.get(f"{self.router.url}/router/stats", timeout=10).json()

    def node_entry(self, name: str) -> dict:
        entries = [e for role in self.stats()["nodes"].values() for e in role]
        return next(e for e in entries if e["id"] == name)

    def pool_healthy(self, count: int) -> bool:
        try:
            nodes = self.stats()["nodes"].values()
        except httpx.HTTPError:
            return False
        return sum(e["health"] == "healthy" for role in nodes for e in role) == count

    def kv_bytes(self, name: str) -> float:
        text = httpx.get(f"{self.nodes[name].url}/metrics", timeout=10).text
        lines = [line for line in text.splitlines() if line.startswith("mlxcel:kv_cache_bytes")]
        return float(lines[0].split()[-1])

    @staticmethod
    def wait_until(predicate, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # bounded by the deadline
            if predicate():
                return
            time.sleep(0.1)
        raise TimeoutError("condition not met in time")

    # ------------------------------------------------------------ load

    def stream(self, prompt: str, max_tokens: int, *, seed: int | None = None,
               on_tokens=None) -> Outcome:
        """One streamed completion; ``on_tokens(count)`` after each chunk with text."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0.0 if seed is None else 0.8}
        if seed is not None:
            body["seed"] = seed
        outcome, chunks, start = Outcome(), 0, time.monotonic()
        try:
            with httpx.stream("POST", f"{self.router.url}/v1/completions", json=body,
                              timeout=httpx.Timeout(STREAM_DEADLINE_S)) as response:
                if response.status_code != 200:
                    outcome.errors.append(f"HTTP {response.status_code}")
                    return outcome
                for line in response.iter_lines():
                    chunks += _read_event(line, outcome)
                    if on_tokens is not None and chunks:
                        on_tokens(chunks)
        except httpx.HTTPError as exc:
            outcome.errors.append(f"{type(exc).__name__}: {exc}")
        outcome.elapsed_s = time.monotonic() - start
        return outcome

    def streams(self, prompts: list[str], max_tokens: int, **kwargs) -> list:
        """Start one stream per prompt on threads; returns their futures."""
        pool = ThreadPoolExecutor(len(prompts))
        futures = [pool.submit(self.stream, p, max_tokens, **kwargs) for p in prompts]
        pool.shutdown(wait=False)
        return futures


def _read_event(line: str, outcome: Outcome) -> int:
    """Fold one SSE line into ``outcome``; 1 when it carried text."""
    if not line.startswith("data: "):
        return 0
    if line == "data: [DONE]":
        outcome.done = True
        return 0
    event = json.loads(line[6:])
    if "error" in event:
        outcome.errors.append(str(event["error"]))
        return 0
    choice = event["choices"][0]
    outcome.text += choice.get("text") or ""
    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    return 1 if choice.get("text") else 0


def port_open(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def _ended(pid: int) -> bool:
    """Whether ``pid`` has exited: gone, or a zombie its parent has not reaped."""
    return process_state(pid) in (None, "Z", "X")
