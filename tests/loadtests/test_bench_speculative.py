"""``python -m loadtests.bench_speculative --quick`` end to end on the tiny model.

Structure only: which tables and rows appear, never how fast anything was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 900


def test_quick_run_prints_and_writes_every_table(tmp_path):
    out = tmp_path / "speculative.json"
    done = subprocess.run([sys.executable, "-m", "loadtests.bench_speculative", "--quick",
                           "--streams", "1", "--code-prompts", "2", "--tool-prompts", "2",
                           "--chat-prompts", "2", "--max-tokens", "24", "--json", str(out)],
                          cwd=REPO, check=True, timeout=RUN_TIMEOUT_S, capture_output=True,
                          text=True)
    assert "greedy flips vs plain" in done.stdout
    tables = {t["title"]: t for t in json.loads(out.read_text())["tables"]}
    speeds = tables["decode tokens/s per stream (median)"]["rows"]
    workloads = ("code-edit", "tool-call", "open-chat")
    assert [(row[0], row[2]) for row in speeds] == [
        (name, mode) for name in workloads for mode in ("plain", "ngram", "draft")]
    assert all(row[3] > 0 for row in speeds)
    flips = tables["greedy flips vs plain (first concurrency)"]["rows"]
    assert [row[:3] for row in flips] == [
        *([name, mode, 2] for name in workloads for mode in ("ngram", "draft")),
        ["all", "ngram", 6], ["all", "draft", 6]]
    draft_rows = [row for row in speeds if row[2] == "draft"]
    assert all(row[4] > 0 for row in draft_rows)  # the model as its own draft proposed
    prefill = tables["draft prefill of a 2048-token prompt (decode node)"]["rows"]
    assert prefill[0][0] > 0
