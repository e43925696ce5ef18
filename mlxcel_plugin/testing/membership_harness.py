"""Drive a router whose membership changes: a bounded load, its stats, a peers file.

Shared by tests/integration/test_membership.py and loadtests/bench_membership.py.
Everything goes over HTTP to real processes (``LocalCluster``); the router must
run with ``MLXCEL_ROUTER_STATS_VERBOSE=1`` for ``node_id_at`` to see addresses.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

STATS_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 60.0


def router_stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/router/stats", timeout=STATS_TIMEOUT_S).json()


def node_entry(stats: dict[str, Any], role: str, address: str) -> dict[str, Any] | None:
    """The pool entry of the node at ``address`` (None when it is not in the pool)."""
    return next((e for e in stats["nodes"][role] if e["address"] == address), None)


def wait_until(predicate: Callable[[], Any], timeout_s: float, poll_s: float = 0.02) -> float:
    """Seconds until ``predicate()`` is truthy; TimeoutError past ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"not true within {timeout_s}s")
        time.sleep(poll_s)
    return time.monotonic() - start


def _entry_toml(entry: str | dict[str, str]) -> str:
    if isinstance(entry, str):
        return f'"{entry}"'
    return "{ " + ", ".join(f'{k} = "{v}"' for k, v in entry.items()) + " }"


def write_peers_file(path: Path, prefill: Iterable[str | dict[str, str]],
                     decode: Iterable[str | dict[str, str]]) -> None:
    """Replace the file atomically (as an editor or a config manager would)."""
    lines = [f"{role} = [{', '.join(_entry_toml(e) for e in entries)}]"
             for role, entries in (("prefill", prefill), ("decode", decode))]
    temporary = path.with_suffix(".tmp")
    temporary.write_text("\n".join(lines) + "\n")
    os.replace(temporary, path)


@dataclass
class BoundedLoad:
    """``workers`` threads, each with one completion in flight at a time, until ``stop``."""

    url: str
    model: str
    workers: int = 4
    max_tokens: int = 16
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> BoundedLoad:
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(self.workers)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> BoundedLoad:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S)
        return self

    def _run(self, worker: int) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            turn = 0
            while not self._stop.is_set():
                turn += 1
                self._one(client, f"membership worker {worker} turn {turn}")

    def _one(self, client: httpx.Client, prompt: str) -> None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens}
        try:
            reply = client.post(f"{self.url}/v1/completions", json=body)
            good = reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
            error = "" if good else f"{reply.status_code}: {reply.text[:200]}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            if error:
                self.failures.append(error)
            else:
                self.ok += 1
