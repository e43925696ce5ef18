"""``loadtests/bench_network.py``: its pure parts, its bare-link transfer, and ``--quick``.

The smoke run starts the benchmark's nodes on the tiny checkpoint in network
namespaces and checks the JSON it writes (rows for every configuration, the
selector's choice, a raw TCP row); no timing assertions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.netns.conftest import GBIT, require_netns

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "loadtests" / "bench_network.py"
sys.path.insert(0, str(BENCH.parent))  # loadtests/ is scripts: import as they do
from bench_network import QUICK_CONFIGS, Case, CpuSampler, Sample, hidden_rows  # noqa: E402

from mlxcel_plugin.testing.netns import NetnsTopology  # noqa: E402


def sample(handoff_s: float, strategy: str, cpu_s: tuple[float, float] = (0.5, 0.25)) -> Sample:
    return Sample(1.0, 2.0, handoff_s, 1 << 30, 1 << 30, {"strategy": strategy, "codec": "none"},
                  list(cpu_s))


def test_cases_report_whole_transfers_against_the_link_and_streamed_as_hidden():
    full = Case(1.0, 2048, "full-none", [sample(10.0, "full"), sample(12.0, "full")])
    streamed = Case(1.0, 2048, "streamed-none", [sample(1.1, "streamed")])
    assert full.effective_x() == (1 << 30) / 11.0 / 125e6
    assert (full.cpu_per_gib(0), full.cpu_per_gib(1)) == (0.5, 0.25)
    assert streamed.effective_x() is None and streamed.cpu_per_gib(0) is None
    assert hidden_rows([full, streamed]) == [[1.0, 2048, 11.0, 1.1, 90.0]]


def test_the_cpu_sampler_reads_the_nearest_samples():
    sampler = CpuSampler([1])
    sampler.samples = [(0.0, [1.0]), (1.0, [1.5]), (2.0, [3.0])]
    assert sampler.between(0.1, 1.9) == [2.0]


def test_the_bare_link_transfer_moves_the_bytes_between_namespaces():
    require_netns()
    from bench_network import raw_transfer

    with NetnsTopology(("prefill", "decode"), rate_bits_per_s=GBIT) as net:
        found = raw_transfer(net, 8 << 20)
    assert found["seconds"] > 0 and found["send_cpu_s"] >= 0 and found["recv_cpu_s"] >= 0


def test_quick_run_writes_a_row_per_configuration(tmp_path):
    require_netns()
    out = tmp_path / "network.json"
    # Its workdir (kept, with the nodes' logs) goes under tmp_path, not /tmp.
    subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], cwd=BENCH.parent,
                   check=True, timeout=600, capture_output=True,
                   env={**os.environ, "TMPDIR": str(tmp_path)})
    result = json.loads(out.read_text())
    handoffs, raw, hidden = result["tables"]
    configs = [row[handoffs["columns"].index("config")] for row in handoffs["rows"]]
    assert configs == list(QUICK_CONFIGS)
    chosen = [row[handoffs["columns"].index("chosen")] for row in handoffs["rows"]]
    assert [c.split()[0] for c in chosen[:2]] == ["full/none", "streamed/none"]
    assert {c.split()[1] for c in chosen} <= {"(link)", "(sender)", "(receiver)"}, chosen
    assert len(raw["rows"]) == 1 and len(hidden["rows"]) == 1
