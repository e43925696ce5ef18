"""``loadtests/bench_multiturn.py --quick`` end to end, and the bench_common helpers it adds.

The smoke run starts every server of the benchmark on the tiny checkpoint and
checks the JSON it writes: a per-turn row with numbers for every server and
workload (no timing assertions).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "loadtests" / "bench_multiturn.py"
# loadtests/ is scripts, not a package: import its helpers the way the scripts do.
sys.path.insert(0, str(BENCH.parent))
from bench_common import (  # noqa: E402
    StreamRecorder,
    format_table,
    prometheus_value,
    table,
    write_toml_config,
)
from bench_multiturn import DEFAULT_SERVERS, NA  # noqa: E402
from multiturn_workloads import make_workloads  # noqa: E402

SERVERS = DEFAULT_SERVERS.split(",")
WORKLOADS = ("chat", "agent")
QUICK_TURNS = 3
QUICK_CONVERSATIONS = 2
RUN_TIMEOUT_S = 900

EXPOSITION = """\
# HELP mlxcel:handoff_bytes Encoded KV bytes per handoff.
# TYPE mlxcel:handoff_bytes histogram
mlxcel:handoff_bytes_bucket{le="1024.0"} 0.0
mlxcel:handoff_bytes_sum 5.0e+06
mlxcel:handoff_bytes_count 3.0
mlxcel:prefix_cache_hit_tokens_total 12.0
mlxcel:prefill_requests_total{outcome="ok"} 2.0
mlxcel:prefill_requests_total{outcome="cancelled"} 1.0
"""


def test_prometheus_value_sums_labelled_samples_and_skips_longer_names():
    assert prometheus_value(EXPOSITION, "mlxcel:handoff_bytes_sum") == 5.0e6
    assert prometheus_value(EXPOSITION, "mlxcel:prefix_cache_hit_tokens_total") == 12.0
    assert prometheus_value(EXPOSITION, "mlxcel:prefill_requests_total") == 3.0
    assert prometheus_value(EXPOSITION, "mlxcel:handoff_bytes") is None  # only _sum/_count exist
    assert prometheus_value(EXPOSITION, "mlxcel:prefix_cache_lookup_tokens_total") is None


def test_stream_recorder_keeps_reply_text_and_cached_tokens():
    recorder = StreamRecorder(kind="chat")
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": " Hello"}}]},
        {"choices": [{"delta": {"content": " there"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 4}}},
    ]  # fmt: skip
    for index, chunk in enumerate(chunks):
        recorder.feed("data: " + json.dumps(chunk), now_s=0.1 * (index + 1))
    recorder.feed("data: [DONE]", now_s=0.4)
    result = recorder.finish(e2e_s=0.5)
    assert result.ok, result.error
    assert (result.text, result.cached_tokens, result.prompt_tokens) == (" Hello there", 4, 9)


def test_cached_tokens_is_none_when_the_server_does_not_report_it():
    recorder = StreamRecorder(kind="chat")
    recorder.feed('data: {"choices": [], "usage": {"prompt_tokens": 3}}', now_s=0.1)
    assert recorder.finish(e2e_s=0.2).cached_tokens is None


def test_write_toml_config_round_trips(tmp_path: Path):
    path = tmp_path / "node.toml"
    sections = {"prefix_cache": {"reuse_generated": True, "max_bytes": 1024, "mode": 'a"b'}}
    assert write_toml_config(path, sections) == ["--distributed-config", str(path)]
    assert tomllib.loads(path.read_text()) == sections


def test_format_table_aligns_columns():
    text = format_table(table("T", ["a", "long name"], [[1, "x"], ["wide cell", 2.5]]))
    assert text.splitlines() == ["T", "        a  long name", "        1          x",
                                 "wide cell        2.5"]  # fmt: skip


def test_quick_workloads_are_deterministic_and_share_their_system_prompt():
    first = make_workloads(WORKLOADS, QUICK_CONVERSATIONS, quick=True)
    again = make_workloads(WORKLOADS, QUICK_CONVERSATIONS, quick=True)
    assert first == again
    for workload in first:
        openers = {workload.user_message(c, 1) for c in range(QUICK_CONVERSATIONS)}
        assert len(openers) == QUICK_CONVERSATIONS  # per-conversation context
        assert workload.user_message(0, 2) != workload.user_message(0, 1)
    full = make_workloads(WORKLOADS, 3, quick=False)
    assert all(len(w.system) > 4 * len(q.system) for w, q in zip(full, first, strict=True))


@pytest.fixture(scope="module")
def quick_result(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    json_path = tmp_path_factory.mktemp("bench-multiturn") / "multiturn.json"
    argv = [sys.executable, str(BENCH), "--quick", "--json", str(json_path)]
    argv += ["--model", str(tiny_model_path)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"bench exited {done.returncode}:\n{output}"
    assert "request failed" not in output, output
    return json.loads(json_path.read_text())


def turn_tables(result: dict) -> dict[str, dict]:
    return {t["title"].split()[0]: t for t in result["tables"] if "per turn (" in t["title"]}


def is_number(cell: object) -> bool:
    return isinstance(cell, int | float) and not isinstance(cell, bool)


def test_every_server_has_a_numeric_row_per_turn_and_workload(quick_result: dict):
    assert quick_result["name"] == "multiturn"
    tables = turn_tables(quick_result)
    assert sorted(tables) == sorted(WORKLOADS)
    for workload, result_table in tables.items():
        columns = result_table["columns"]
        rows = {(row[0], row[1]): dict(zip(columns, row, strict=True))
                for row in result_table["rows"]}  # fmt: skip
        expected = {(s, t) for s in SERVERS for t in range(1, QUICK_TURNS + 1)}
        assert set(rows) == expected, workload
        for (server, turn), row in rows.items():
            assert row["ok"] == f"{QUICK_CONVERSATIONS}/{QUICK_CONVERSATIONS}", (server, turn)
            assert is_number(row["TTFT p50 ms"]) and is_number(row["TTFT p99 ms"]), row
            assert is_number(row["prompt tok"]) and row["prompt tok"] > 0, row
            figures = [v for k, v in row.items() if k not in ("server", "turn", "ok")]
            assert all(is_number(v) or v == NA or "/" in str(v) for v in figures), row


def test_cluster_rows_report_the_kv_shipped_and_the_others_have_no_handoff(quick_result: dict):
    for result_table in turn_tables(quick_result).values():
        columns = result_table["columns"]
        for row in (dict(zip(columns, r, strict=True)) for r in result_table["rows"]):
            handoff = [row[k] for k in ("handoffs", "local prefills", "KV shipped MiB/req")]
            if not row["server"].startswith("cluster"):
                assert handoff == [NA] * 3, row
                continue
            assert all(is_number(v) and v >= 0 for v in handoff), row
            if row["turn"] == 1:  # the decode node holds nothing yet: the prefill node ships
                assert row["handoffs"] > 0 and row["KV shipped MiB/req"] > 0, row


def test_cache_on_replies_equal_the_cache_off_replies(quick_result: dict):
    # Exact mode: a prefix-cache hit never changes the output (greedy).
    complete = f"{QUICK_CONVERSATIONS}/{QUICK_CONVERSATIONS}"
    for result_table in turn_tables(quick_result).values():
        same = result_table["columns"][-1]
        assert same == "replies = hybrid-off"
        for row in result_table["rows"]:
            if row[0] in ("hybrid-off", "hybrid-on"):
                assert row[-1] == complete, row


def test_summary_tables_cover_every_server(quick_result: dict):
    titles = {t["title"]: t for t in quick_result["tables"]}
    pivot = titles["TTFT p50 ms per turn"]
    assert {(row[0], row[1]) for row in pivot["rows"]} == {
        (s, w) for s in SERVERS for w in WORKLOADS
    }
    assert all(is_number(cell) for row in pivot["rows"] for cell in row[2:]), pivot
    throughput = titles["Throughput per server and workload"]
    assert len(throughput["rows"]) == len(SERVERS) * len(WORKLOADS)
    assert all(row[2] == QUICK_CONVERSATIONS * QUICK_TURNS for row in throughput["rows"])
    assert titles["Targets (issue 17)"]["rows"], "no target rows"


def test_a_server_with_its_own_chunk_size_writes_it_in_its_node_config(tmp_path: Path):
    from bench_multiturn import SERVERS as SPECS  # noqa: E402 (loadtests/ is on sys.path)

    flag, path = SPECS["hybrid-on-c32"].node_args(tmp_path)
    sections = tomllib.loads(Path(path).read_text())
    assert flag == "--distributed-config"
    assert sections == {"prefill_scheduler": {"chunk_size_tokens": 32}}
    assert SPECS["hybrid-on"].node_args(tmp_path) == []
