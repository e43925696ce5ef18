"""``loadtests/bench_kv_plane.py --quick`` end to end (loopback, tiny KV shape), its bare
baselines between two processes, and how its report judges rows against issue 40's targets.

Structure only: which rows and tables appear, never how fast anything was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "loadtests" / "bench_kv_plane.py"
sys.path.insert(0, str(BENCH.parent))  # loadtests/ is scripts: import as they do
from harness import ThreadCpu, proc_cpu_s  # noqa: E402
from kv_plane_report import gib_s, link_reference, target_rows  # noqa: E402

from mlxcel_plugin.libc import name_os_thread  # noqa: E402
from mlxcel_plugin.local_cluster import LOOPBACK, free_port  # noqa: E402

RUN_TIMEOUT_S = 600
GIB = 1 << 30


def test_quick_run_prints_and_writes_every_path_and_table(tmp_path):
    out = tmp_path / "kv_plane.json"
    # Its workdir (kept, with the nodes' logs) goes under tmp_path, not /tmp.
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--no-pin", "--json", str(out)],
                          cwd=REPO, check=True, timeout=RUN_TIMEOUT_S, capture_output=True,
                          text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert "KV plane: every path" in done.stdout and "Issue 40 targets" in done.stdout
    result = json.loads(out.read_text())
    plane, threads, proof, itl, targets = result["tables"]
    paths = {row[plane["columns"].index("path")] for row in plane["rows"]}
    assert paths == {"raw TCP", "bare AES-GCM", "full-none", "full-int8"}
    chosen = {row[plane["columns"].index("chosen")] for row in plane["rows"]}
    assert {"full/none", "full/int8"} <= chosen  # the nodes ran what was asked
    # The decode node's CPU by thread, a figure per role for each path. Structure only: a
    # quick run's handoff can fall between two 5 ms samples, so its readers may read 0
    # (how roles are told apart: the next test).
    assert {row[2] for row in threads["rows"]} == {"full-none", "full-int8"}
    for role in ("lanes", "loop", "engine", "other", "all"):
        column = threads["columns"].index(role)
        assert all(isinstance(row[column], (int, float)) for row in threads["rows"])
    assert proof["rows"] == []  # loopback is not shaped
    assert [row[0] for row in itl["rows"]] == ["loopback"]
    assert itl["rows"][0][itl["columns"].index("quiet gaps")] > 0
    assert {row[2] for row in targets["rows"]} >= {"full-none GiB/s >= 0.9x AES"}
    assert result["run"]["lanes"] >= 1 and result["machine"]["cores"]


def test_a_process_cpu_is_split_by_the_roles_its_threads_name_themselves():
    def reader(stop: threading.Event) -> None:
        name_os_thread()
        while not stop.is_set():  # bounded by the stop below
            sum(range(1000))

    stop = threading.Event()
    thread = threading.Thread(target=reader, args=(stop,), name="mlxcel-bulk-in7_0")
    threads = ThreadCpu(os.getpid())
    thread.start()
    try:
        first = threads.by_role()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # bounded: until the reader has run 20 ms more
            later = threads.by_role()
            if later.get("lanes", 0.0) - first.get("lanes", 0.0) > 0.02:
                break
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    assert later["lanes"] - first.get("lanes", 0.0) > 0.02
    assert "loop" in later  # this process's main thread
    ended = threads.by_role()  # the reader is gone: its CPU stays counted
    assert ended["lanes"] >= later["lanes"]
    threads.close()


def test_a_process_cpu_reads_finer_than_clock_ticks():
    """``proc_cpu_s`` reads a process's CPU clock: this process's own reads the same as
    ``time.process_time`` (ticks were 10 ms apart), and a process that is gone reads 0."""
    before = time.process_time()
    reading = proc_cpu_s(os.getpid())
    after = time.process_time()
    assert before <= reading <= after
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert proc_cpu_s(child.pid) == 0.0


def run_baseline(aes: bool, size: int = 5 << 20) -> tuple[dict, dict]:
    script = REPO / "loadtests" / "tcp_baselines.py"
    port = str(free_port())
    extra = ["--lanes", "3", "--record", str(1 << 20), *(["--aes"] if aes else [])]
    sink = subprocess.Popen([sys.executable, str(script), "sink", LOOPBACK, port, str(size),
                             *extra], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        sent = subprocess.run([sys.executable, str(script), "send", LOOPBACK, port, str(size),
                               *extra], capture_output=True, text=True, check=True, timeout=60)
        received = json.loads(sink.stdout.readline())
    finally:
        sink.wait(timeout=60)
    assert sink.returncode == 0  # an AES record that failed to open would have raised there
    return json.loads(sent.stdout), received


def test_the_baselines_move_every_byte_over_several_lanes():
    for aes in (False, True):
        sent, received = run_baseline(aes)
        assert received["bytes"] == 5 << 20
        assert sent["seconds"] > 0 and sent["cpu_s"] >= 0 and received["cpu_s"] >= 0


def row(path: str, seconds: float, send: float, recv: float, tokens: int = 8192) -> dict:
    return {"link": "tbf10", "tokens": tokens, "path": path, "bytes": GIB, "wire_bytes": GIB,
            "seconds": seconds, "cpu_send_per_gib": send, "cpu_recv_per_gib": recv}


def test_targets_are_judged_against_the_baseline_of_the_same_link_and_size():
    rows = [row("raw TCP", 0.9, 0.2, 0.2), row("bare AES-GCM", 0.8, 0.3, 0.3),
            row("full-none", 0.85, 0.36, 0.6), row("full-int8", 0.6, 0.5, 1.2)]
    proof = {"rate_bits": 10e9, "proven": True, "reference_bits": 10e9, "tries": []}
    result = {"link": "tbf10", "rate_bits": 10e9, "proof": proof, "rows": rows}
    assert link_reference(result, 8192) == 10e9 / 8 / GIB
    judged = {target: (measured, verdict) for _, _, target, measured, verdict
              in target_rows(result)}
    assert judged["full-none send CPU/GiB <= 1.3x AES"] == (1.2, "meets")
    assert judged["full-none recv CPU/GiB <= 1.3x AES"] == (2.0, "misses")
    assert judged["full-none GiB/s >= 0.9x AES"] == (0.94, "meets")
    assert judged["full-int8 recv CPU s/GiB <= 1.0"] == (1.2, "misses")
    # The AES baseline reaches 10 Gbit/s (1.25 GiB/s > 0.9 x 1.164): the rate target applies.
    assert judged["full-none >= 0.9x 10 Gbit/s"][1] == "meets"
    assert gib_s(rows[1]) == 1.25
