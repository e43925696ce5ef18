"""``loadtests/bench_adapters.py`` end to end on the tiny model (in process, then one hybrid
node for ``load_lora_adapter``): every case and figure is printed. Structure only, never how
fast anything was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 600


def test_a_quick_run_prints_every_case() -> None:
    done = subprocess.run([sys.executable, "loadtests/bench_adapters.py", "--model", "tiny",
                           "--steps", "2", "--repeats", "1", "--rank", "2"], cwd=REPO,
                          check=True, timeout=RUN_TIMEOUT_S, capture_output=True, text=True)
    for case in ("base x8", "1 adapter x8", "4 adapters x2", "8 adapters x1",
                 "8 distinct / 1 adapter", "in process: AdapterSet.load",
                 "hybrid node: load_lora_adapter", "first token after it"):
        assert case in done.stdout, done.stdout
