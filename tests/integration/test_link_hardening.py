"""An authenticated peer that breaks the rules, against real node processes (fake engine).

A router-role peer is not trusted to have validated: bad REQUEST fields get a
named ERROR frame and the node keeps serving. A peer's declared sizes are not
memory until its bytes arrive; the decode KV budget bounds KV in flight; junk
before authentication costs one log line. Attacks use ``testing.link_attacker``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxcel_plugin.link.protocol.frames import Cancel, ErrorFrame, FrameType
from mlxcel_plugin.local_cluster import LOOPBACK, NodeProcess, free_port
from mlxcel_plugin.testing.link_attacker import announce_bulk_body, raw_request, send_junk
from tests.integration.test_nodes import (
    Nodes,
    as_prefill,
    driver,
    fake_fingerprint,
    handoff_frames,
    health,
    next_ack,
    run,
    wait_baseline,
)

MIB = 1 << 20
HANDOFF_PROMPT, HANDOFF_MAX_TOKENS = [4] * 8, 4
BUDGET_FITS = 2  # handoffs the tight decode node's KV budget holds at once
SLOW_TIMEOUT_S = 20.0  # transfer_timeout_s: a refusal "at once" comes long before it


def rss_bytes(node: NodeProcess) -> int:
    status = Path(f"/proc/{node.process.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.fixture(scope="module")
def hard_nodes(tmp_path_factory) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("hardening")
    nodes = Nodes(workdir)
    fake = ["--engine", "fake", "--model", str(workdir)]
    toml = f"[transfer]\ntransfer_timeout_s = {SLOW_TIMEOUT_S}\n"
    handoff_bytes = fake_fingerprint().kv_bytes(len(HANDOFF_PROMPT) + HANDOFF_MAX_TOKENS)
    tight = toml + (f"[decode_scheduler]\nkv_budget_bytes = {int(handoff_bytes * 2.5)}\n"
                    "memory_threshold = 1.0\n")
    decode_bind = f"{LOOPBACK}:{free_port()}"
    started = {
        "decode": nodes.start("decode", "decode-hard", fake, toml, bind=decode_bind),
        "tight": nodes.start("decode", "decode-tight", fake, tight),
        "prefill": nodes.start("prefill", "prefill-hard", fake, toml),
    }
    try:
        nodes.wait_all(60)
        yield {"nodes": nodes, **started}
    finally:
        nodes.stop_all()
        logs = {n.log_path.name: n.log_path.read_text(errors="replace") for n in nodes.started}
        leaked = [name for name, text in logs.items() if "never retrieved" in text]
        assert not leaked, f"asyncio exceptions never retrieved in {leaked}"


@pytest.mark.parametrize("sampling", [{"temperature": math.nan}, {"min_p": math.nan},
                                      {"top_p": math.inf}, {"seed": 2**63}])
def test_out_of_range_sampling_from_a_router_gets_a_named_error(hard_nodes, sampling):
    nodes, prefill, decode = hard_nodes["nodes"], hard_nodes["prefill"], hard_nodes["decode"]

    # The nodes serve the whole module: ids of their own per case, or a case's "fine"
    # meets the previous case's ended "fine" on the decode node.
    case = next(iter(sampling))

    async def go():
        async with driver(nodes, prefill, decode) as attacker:
            bad = attacker.expect(f"bad-{case}")
            await attacker.prefill.send(raw_request(f"bad-{case}", [5] * 8, sampling=sampling))
            local = attacker.expect(f"bad-local-{case}")  # the decode node checks the same
            await attacker.decode.send(raw_request(f"bad-local-{case}", [5] * 8,
                                                   sampling=sampling))
            outcomes = [await attacker.wait(c, 10) for c in (bad, local)]
            fine = await attacker.generate(f"fine-{case}", [8] * 10, 3)
            return outcomes, fine

    outcomes, fine = run(go())
    assert [o.error_code for o in outcomes] == ["frame_field_out_of_range"] * 2
    assert not any(o.tokens for o in outcomes)  # nothing reached an engine
    assert fine.ok


@pytest.mark.parametrize("target", ["127.0.0.1:9 ", "127.0.0.1", "[::1:9"])
def test_a_malformed_decode_target_is_refused_at_once(hard_nodes, target):
    nodes, prefill, decode = hard_nodes["nodes"], hard_nodes["prefill"], hard_nodes["decode"]

    async def go():
        async with driver(nodes, prefill, decode) as attacker:
            collector = attacker.expect("target")
            await attacker.prefill.send(raw_request("target", [5] * 8, decode_target=target))
            return await attacker.wait(collector, SLOW_TIMEOUT_S / 4)

    outcome = run(go())
    assert outcome.error_code == "decode_target_malformed"


def test_declared_bulk_sizes_are_not_allocated_before_their_bytes(hard_nodes):
    nodes, decode = hard_nodes["nodes"], hard_nodes["decode"]

    async def go():
        link = await as_prefill(nodes, decode)
        before = rss_bytes(decode)
        await announce_bulk_body(link, 400 * MIB)
        await announce_bulk_body(link, 400 * MIB)
        peak = before
        for _ in range(30):  # ~1.5 s: the old code had the 800 MiB at once
            await asyncio.sleep(0.05)
            peak = max(peak, rss_bytes(decode))
        await link.close()
        return before, peak

    before, peak = run(go())
    assert peak - before < 64 * MIB, f"RSS grew {(peak - before) / MIB:.0f} MiB"
    assert health(decode)["status"] == "ok"


def test_the_decode_kv_budget_bounds_handoffs_in_flight(hard_nodes):
    nodes, tight = hard_nodes["nodes"], hard_nodes["tight"]
    fingerprint = fake_fingerprint()

    async def go():
        link = await as_prefill(nodes, tight)
        for i in range(6):  # unclaimed: admitted ones hold their KV, waiting for a claim
            for frame in handoff_frames(f"h{i}", HANDOFF_PROMPT, fingerprint,
                                        HANDOFF_MAX_TOKENS):
                await link.send(frame)
        refusals = [await next_ack(link, 10) for _ in range(6 - BUDGET_FITS)]
        held = health(tight)
        for i in range(BUDGET_FITS):  # as a prefill node whose requests ended: frees them
            await link.send(Cancel(f"h{i}", "test over").to_frame())
        await link.close()
        return refusals, held

    refusals, held = run(go())
    assert sorted(a.request_id for a in refusals) == [f"h{i}" for i in range(BUDGET_FITS, 6)]
    assert {a.error_code for a in refusals} == {"at_capacity"}
    assert all("KV budget full" in (a.error or "") for a in refusals)
    assert held["ready"] + held["ingesting"] == BUDGET_FITS
    wait_baseline(tight)  # the admitted ones' KV freed by the cancel, not at transfer_timeout_s


def test_junk_before_authentication_costs_one_warning_line(hard_nodes):
    decode = hard_nodes["decode"]
    log_before = decode.log_path.read_text(errors="replace")

    async def go():
        await send_junk(decode.serving_bind, b"\x16\x03\x01\x02\x00\x01\x00junk" * 20, 50)
        await send_junk(decode.serving_bind, b"GET /link HTTP/1.1\r\nHost: x\r\n\r\n", 50)

    run(go())
    time.sleep(0.5)
    added = decode.log_path.read_text(errors="replace")[len(log_before):]
    assert "Traceback" not in added and " ERROR " not in added
    assert 1 <= added.count("before authentication") <= 2, added[-2000:]
    assert len(added.encode()) < 4096
    assert health(decode)["status"] == "ok"


def test_fields_checked_on_arrival_do_not_break_a_good_stream(hard_nodes):
    nodes, prefill, decode = hard_nodes["nodes"], hard_nodes["prefill"], hard_nodes["decode"]

    async def go():
        async with driver(nodes, prefill, decode) as client:
            sampling = {"temperature": 2.0, "top_p": 1.0, "min_p": 0.0, "seed": -(2**63)}
            return await client.generate("edge", [8] * 10, 3, sampling=sampling)

    assert run(go()).ok
    assert isinstance(ErrorFrame("x").to_frame().type, FrameType)
