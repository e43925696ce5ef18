"""``loadtests/bench_receiver_loop.py`` on short prompts: every case completes its handoffs
(the receiver raises otherwise) and prints its row, and a large-chunk handoff of a tensor
above one record goes in fewer chunks. Structure only, never how fast anything was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_quick_run_prints_every_case_with_its_chunk_count() -> None:
    done = subprocess.run([sys.executable, "loadtests/bench_receiver_loop.py", "--tokens",
                           "256,5120", "--repeats", "1", "--warmup", "0", "--profile",
                           "256:large"], cwd=REPO, check=True, timeout=300,
                          capture_output=True, text=True)
    rows = {tuple(line.split()[:2]): line.split() for line in done.stdout.splitlines()
            if len(line.split()) == 6 and line.split()[1] in ("record", "large")}
    assert set(rows) == {(t, c) for t in ("256", "5120") for c in ("record", "large")}
    # 5120 tokens: a 10 MiB tensor is two record-sized chunks, or one large one (64 tensors).
    assert (rows[("5120", "record")][3], rows[("5120", "large")][3]) == ("128", "64")
    assert rows[("256", "record")][3] == rows[("256", "large")][3] == "64"
    assert "function calls" in done.stdout  # the profile printed
