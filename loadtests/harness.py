"""What the ``loadtests/bench_*.py`` scripts share beyond ``bench_common``: CPU time of
processes (whole, or sampled over a window), which cores each process may use, and
the product's KV-plane defaults a baseline must match.

``bench_common`` holds figures and streams (percentiles, JSON, SSE timing); this
module holds the measuring of processes.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

GIB = 1 << 30
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- CPU time


def process_cpu_s() -> float:
    """This process's CPU seconds (user + system, every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (None once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None


def _process_cpu_clock(pid: int) -> int:
    """Linux's CPU-time clock of process ``pid`` (``clock_getcpuclockid``: every thread's
    time on CPU, ended ones too), which ``time.clock_gettime`` reads in nanoseconds."""
    return ((~pid) << 3) | 2  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def proc_cpu_s(pid: int) -> float:
    """Another process's CPU seconds (0 once it is gone).

    Why the CPU clock: ``/proc/PID/stat`` counts in clock ticks (10 ms), as much as a
    2k-token handoff's whole receive costs a tenth of; where the clock is not there (not
    Linux), ticks it is."""
    try:
        return time.clock_gettime(_process_cpu_clock(pid))
    except (OSError, AttributeError, OverflowError):
        stat = _proc_stat(pid)
        return (int(stat[11]) + int(stat[12])) / CLOCK_TICKS if stat else 0.0  # utime + stime


def proc_minor_faults(pid: int) -> int:
    """Another process's minor page faults so far (0 once it is gone)."""
    stat = _proc_stat(pid)
    return int(stat[7]) if stat else 0  # minflt


@dataclass
class CpuSampler:
    """CPU seconds of some processes every ``period_s``, timestamped (perf_counter); with
    ``threads_of``, also that process's CPU by thread role (``ThreadCpu``)."""

    pids: list[int]
    period_s: float = 0.005
    threads_of: int | None = None
    samples: list[tuple[float, list[float]]] = field(default_factory=list)
    thread_samples: list[dict[str, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> CpuSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        threads = ThreadCpu(self.threads_of) if self.threads_of is not None else None
        while not self._stop.is_set():
            sample = (time.perf_counter(), [proc_cpu_s(pid) for pid in self.pids])
            if threads is not None:  # first: a reader indexes both lists by ``samples``
                self.thread_samples.append(threads.by_role())
            self.samples.append(sample)
            self._stop.wait(self.period_s)
        if threads is not None:
            threads.close()

    def between(self, start_s: float, end_s: float) -> list[float]:
        """CPU seconds of each process from ``start_s`` to ``end_s`` (nearest samples)."""
        a, b = self._nearest(start_s), self._nearest(end_s)
        return [after - before for before, after in zip(self.samples[a][1], self.samples[b][1],
                                                        strict=True)]

    def threads_between(self, start_s: float, end_s: float) -> dict[str, float]:
        """``threads_of``'s CPU seconds by thread role from ``start_s`` to ``end_s``."""
        a, b = self._nearest(start_s), self._nearest(end_s)
        before, after = self.thread_samples[a], self.thread_samples[b]
        return {role: after[role] - before.get(role, 0.0) for role in after}

    def _nearest(self, when: float) -> int:
        return min(range(len(self.samples)), key=lambda i: abs(self.samples[i][0] - when))


def _schedstat_s(handle: Any) -> float | None:
    """A thread's CPU seconds from its open ``schedstat`` (None once the thread is gone)."""
    try:
        handle.seek(0)
        return int(handle.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class ThreadCpu:
    """One process's CPU seconds so far by thread role, from each thread's ``schedstat``
    (nanoseconds on CPU): ``loop`` (the main thread), ``lanes`` (bulk readers), ``engine``
    (the engine thread and the MLX threads it started: a new thread inherits its creator's
    OS name), ``other`` (the rest). Roles come from the names nodes give their threads
    (``mlxcel_plugin.libc.name_os_thread``); a thread that ended keeps its total.
    Files stay open and are re-read in place, so a sample costs a few µs a thread."""

    ROLES = {"bulk-in": "lanes", "mlx-engine": "engine"}

    def __init__(self, pid: int):
        self.pid = pid
        self._files: dict[str, tuple[str, Any]] = {}  # tid -> (role, open schedstat)
        self._last: dict[str, float] = {}  # tid -> its CPU seconds at the last sample
        self._ended: dict[str, float] = {}  # role -> CPU seconds of its threads that are gone
        self._unnamed: dict[str, int] = {}  # tid -> looks left for a name it gives itself

    def by_role(self) -> dict[str, float]:
        for tid in self._tids():
            if tid not in self._files or tid in self._unnamed:
                self._open(tid)
        totals = dict(self._ended)
        for tid, (role, handle) in list(self._files.items()):
            seconds = _schedstat_s(handle)
            if seconds is None:  # the thread ended: its last figure stays in its role's total
                handle.close()
                del self._files[tid]
                seconds = self._last.pop(tid, 0.0)
                self._ended[role] = self._ended.get(role, 0.0) + seconds
            else:
                self._last[tid] = seconds
            totals[role] = totals.get(role, 0.0) + seconds
        return totals

    def _tids(self) -> list[str]:
        try:
            return os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return []

    def _open(self, tid: str) -> None:
        """Open a new thread's schedstat; look again at a thread still unnamed (a node's
        thread names itself as it starts, maybe after its first sample)."""
        try:
            comm = Path(f"/proc/{self.pid}/task/{tid}/comm").read_text().strip()
            handle = self._files[tid][1] if tid in self._files else open(  # noqa: SIM115
                f"/proc/{self.pid}/task/{tid}/schedstat", "rb")
        except OSError:
            return
        role = "loop" if tid == str(self.pid) else next(
            (r for prefix, r in self.ROLES.items() if comm.startswith(prefix)), "other")
        self._files[tid] = (role, handle)
        looks = self._unnamed.pop(tid, 20) - 1
        if role == "other" and looks > 0:
            self._unnamed[tid] = looks

    def close(self) -> None:
        for _, handle in self._files.values():
            handle.close()


# ---------------------------------------------------------------- what was measured


def source_revision() -> str:
    """The checkout's commit, and how many tracked files differ from it (others' edits)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=repo, check=True, capture_output=True, text=True,
                                timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    changed = len(status.splitlines())
    return f"{head} (+{changed} modified tracked files)" if changed else head


# ---------------------------------------------------------------- cores


def available_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Placement:
    """Cores for the sending side (prefill node) and the receiving side (decode node and
    this driver); empty: unpinned. Two cores emulate two machines of one core each."""

    sender: frozenset[int] = frozenset()
    receiver: frozenset[int] = frozenset()

    @classmethod
    def split(cls, pin: bool) -> Placement:
        cores = available_cores()
        if not pin or len(cores) < 2 or not hasattr(os, "sched_setaffinity"):
            return cls()
        return cls(frozenset(cores[:1]), frozenset(cores[1:2]))

    def describe(self) -> str:
        if not self.sender:
            return f"unpinned ({len(available_cores())} cores)"
        return (f"sender core {','.join(map(str, sorted(self.sender)))}, receiver + driver core "
                f"{','.join(map(str, sorted(self.receiver)))}")

    def taskset(self, side: str) -> list[str]:
        """An argv prefix that runs a command on ``side``'s cores (none when unpinned)."""
        cores = self.sender if side == "sender" else self.receiver
        return ["taskset", "-c", ",".join(map(str, sorted(cores)))] if cores else []


def pin_all(pid: int, cores: Collection[int]) -> None:
    """Pin ``pid`` and its threads (they pass it on to threads they start) to ``cores``."""
    from mlxcel_plugin.local_cluster import pin_process

    if cores:
        pin_process(pid, cores)


# ---------------------------------------------------------------- models


def fake_model_dir(root: Path, tiny: Path, knobs: dict[str, Any],
                   context_tokens: int | None = None) -> Path:
    """A checkpoint for ``--engine fake``: the tiny checkpoint's files but its weights, and
    the fake engine's ``knobs`` (``fake_engine.json``); ``context_tokens`` overrides the
    context the front reads from config.json."""
    root.mkdir(parents=True, exist_ok=True)
    for item in tiny.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, root / item.name)
    (root / "fake_engine.json").write_text(json.dumps(knobs))
    if context_tokens is not None:
        config = json.loads((root / "config.json").read_text())
        config["max_position_embeddings"] = context_tokens
        (root / "config.json").write_text(json.dumps(config))
    return root


# ---------------------------------------------------------------- the product's KV plane


@dataclass(frozen=True)
class KVPlaneDefaults:
    """What a bare baseline copies from the product: record size and lanes per peer pair."""

    record_bytes: int
    lanes: int
    source: str  # where the figures came from, for the printout


def kv_plane_defaults() -> KVPlaneDefaults:
    """The product's own defaults, read from the ``LinkConfig`` a prefill node dials decode
    nodes with (``nodes.roles.kv_link_config``; whatever fields it has now)."""
    from mlxcel_plugin.link.config import LinkConfig, default_bulk_lanes
    from mlxcel_plugin.nodes import roles

    make = getattr(roles, "kv_link_config", LinkConfig)
    config = make()
    names = {f.name for f in fields(LinkConfig)}
    record = next((getattr(config, n) for n in ("bulk_record_bytes", "bulk_chunk_bytes")
                   if n in names), 1 << 20)
    lane_field = next((n for n in ("bulk_lanes", "lanes", "bulk_lane_count") if n in names), None)
    lanes = getattr(config, lane_field) if lane_field else 1
    if callable(lanes):
        lanes = lanes()
    # 0 means "from the core count" in the product: one per core this process may run on
    # (the driver sits on the receiving side's cores), up to 4.
    lanes = int(lanes) if lanes else default_bulk_lanes()
    where = f"{make.__name__}().{lane_field}" if lane_field else "no lane field: one connection"
    return KVPlaneDefaults(int(record), max(1, lanes), where)

