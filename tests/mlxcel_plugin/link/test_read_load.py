"""ReadTimer: a reader asleep on its socket reads idle; one running, or runnable but kept
off its CPU by another process, reads busy (Linux counts run-queue waits: schedstat)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from mlxcel_plugin.link.read_load import ReadLoad, ReadTimer

HOG = "import sys; print('ready', flush=True)\nwhile True: pass"


def on_a_thread(work):
    """``work()``'s result, run on a thread of its own (so pinning it pins nothing else)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join(30)
    assert out, "the thread did not finish"
    return out[0]


def spin(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:  # bounded by the deadline
        pass


def test_a_reader_waiting_for_the_link_reads_idle():
    def wait() -> ReadLoad:
        with ReadTimer() as timer:
            time.sleep(0.3)  # as in recv: asleep until bytes come
        return timer.load

    load = on_a_thread(wait)
    assert load.wall_s >= 0.3 and load.busy_share < 0.5


def test_loads_add_and_subtract_and_an_empty_one_has_no_share():
    assert ReadLoad().busy_share is None
    total = ReadLoad(0.5, 1.0) + ReadLoad(0.5, 1.0)
    assert total == ReadLoad(1.0, 2.0) and (total - ReadLoad(1.0, 1.0)).busy_share == 0.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="run-queue waits: Linux")
def test_a_reader_kept_off_its_cpu_by_another_process_reads_busy():
    core = max(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
    try:
        os.sched_setaffinity(hog.pid, {core})
        assert hog.stdout.readline().strip() == "ready"

        def starved() -> tuple[ReadLoad, float]:
            os.sched_setaffinity(0, {core})  # this thread and the hog share one core
            cpu = time.thread_time()
            with ReadTimer() as timer:
                spin(0.4)
            return timer.load, time.thread_time() - cpu

        load, cpu_s = on_a_thread(starved)
    finally:
        hog.kill()
        hog.wait()
    assert cpu_s < 0.8 * load.wall_s  # it had the core only part of the time...
    assert load.busy_share > 0.8  # ...and waited to run the rest: busy, not waiting on a link
