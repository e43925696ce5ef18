"""Delta handoffs between real node processes on 127.0.0.1 (tiny checkpoint, ``LinkDriver``).

The decode node first receives a whole 2,000-token prompt, so its prefix cache
holds the prompt's full chunks; requests that share a prefix of it then go with
``decode_cached_tokens`` and the prefill node ships only the rest. Every reply
must equal the single-node (hybrid) reference, and the prefill node's
``mlxcel:handoff_bytes`` must show only the missing part went. The tiny
model's context is 2,048 tokens, so the nodes chunk by 32 tokens (and so does
the reference) to leave room for a missing part of 2,000+ tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxcel_plugin import openblas
from tests.integration.test_nodes import REPO, Nodes, driver, health, metrics, prompt_of, run

CHUNK = 32
TRANSFERS = [("full", "none"), ("streamed", "none"), ("layer-parallel", "none"),
             ("streamed", "lz4")]
BASE = prompt_of(2000, 7)
HELD = (len(BASE) - 1) // CHUNK * CHUNK  # the full chunks a handoff of BASE leaves cached
# missing part -> cached prefix the router would name (whole chunks the decode node holds)
CASES = {1: HELD, 255: 1760, 256: 1760, 257: 1760, 2004: CHUNK}
# The tiny checkpoint: 4 layers x (K, V) x 2 heads x 16 dims x float32, per token.
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 16 * 4


def case_prompt(missing: int) -> list[int]:
    return BASE[: CASES[missing]] + prompt_of(missing, 20 + missing)


def reference(model: Path, requests: list[dict]) -> dict[str, list[int]]:
    env = openblas.preload_env(os.environ) or dict(os.environ)
    done = subprocess.run([sys.executable, "-m", "tests.integration.hybrid_reference",
                           str(model), str(CHUNK)], input=json.dumps(requests),
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def expected(tiny_model_path) -> dict[str, list[int]]:
    prompts = {"base": BASE, "unheld": prompt_of(1985, 99)}
    prompts.update({f"miss{n}": case_prompt(n) for n in CASES})
    return reference(tiny_model_path, [{"request_id": name, "prompt": prompt, "max_tokens": 6}
                                       for name, prompt in prompts.items()])


@pytest.fixture(scope="module")
def delta_nodes(tmp_path_factory, tiny_model_path) -> Iterator[dict]:
    nodes = Nodes(tmp_path_factory.mktemp("delta-nodes"))
    model = ["--model", str(tiny_model_path)]
    engine = f"[engine]\nchunk_size_tokens = {CHUNK}\n"
    decode = nodes.start("decode", "decode-delta", model, engine)
    prefills = {
        (strategy, codec): nodes.start(
            "prefill", f"prefill-delta-{strategy}-{codec}", model,
            engine + f'[transfer]\nstrategy = "{strategy}"\ncodec = "{codec}"\n'
            "parallelism = 2\nchunk_bytes = 65536\n")
        for strategy, codec in TRANSFERS
    }
    try:
        nodes.wait_all()
        yield {"nodes": nodes, "decode": decode, "prefills": prefills}
    finally:
        nodes.stop_all()


def counter(node, name: str) -> float:
    lines = [line for line in metrics(node).splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def handoff_bytes_after(node, count_before: float, timeout_s: float = 10.0) -> float:
    """Bytes of the handoff acked after ``count_before`` (the ack may trail the tokens)."""
    deadline = time.monotonic() + timeout_s
    while counter(node, "mlxcel:handoff_bytes_count") <= count_before:
        if time.monotonic() > deadline:
            raise AssertionError("the handoff was never acked")
        time.sleep(0.05)
    return counter(node, "mlxcel:handoff_bytes_sum")


async def generate_measured(node, link_driver, request_id: str, prompt: list[int],
                            cached: int) -> tuple[list[int], float]:
    """(tokens, bytes its handoff shipped)."""
    count, total = (counter(node, f"mlxcel:handoff_bytes_{k}") for k in ("count", "sum"))
    outcome = await link_driver.generate(request_id, prompt, 6, decode_cached_tokens=cached)
    assert outcome.ok, outcome
    return outcome.tokens, handoff_bytes_after(node, count) - total


def begin_bytes(prompt_tokens: int, strategy: str) -> int:
    """The begin's body (the prompt as uint32), sent on each lane by layer-parallel."""
    return 4 * prompt_tokens * (2 if strategy == "layer-parallel" else 1)


@pytest.mark.parametrize(("strategy", "codec"), TRANSFERS)
def test_a_delta_handoff_decodes_what_a_single_node_generates(delta_nodes, expected, strategy,
                                                              codec):
    prefill, decode = delta_nodes["prefills"][(strategy, codec)], delta_nodes["decode"]

    async def go():
        async with driver(delta_nodes["nodes"], prefill, decode) as link_driver:
            tag = f"{strategy}-{codec}"
            got = {"base": await generate_measured(prefill, link_driver, f"base-{tag}", BASE, 0)}
            for missing, cached in CASES.items():
                got[f"miss{missing}"] = await generate_measured(
                    prefill, link_driver, f"miss{missing}-{tag}", case_prompt(missing), cached)
            return got

    got = run(go())
    assert {name: tokens for name, (tokens, _) in got.items()} == {
        name: expected[name] for name in got}
    full = got["base"][1]
    sizes = {name: int(sent) for name, (_, sent) in got.items()}
    print(f"{strategy}/{codec} handoff bytes: {sizes}")
    for missing in CASES:
        sent = got[f"miss{missing}"][1]
        assert sent < full * (missing + 64) / len(BASE), (missing, sent, full)
        if codec == "none":  # exactly the missing positions' K/V, and the begin's prompt
            tokens = len(case_prompt(missing))
            assert sent == KV_BYTES_PER_TOKEN * missing + begin_bytes(tokens, strategy)
    assert counter(prefill, "mlxcel:handoff_prefix_missing_total") == 0
    assert health(prefill)["transfer"]["last_choice"]["codec"] == codec  # what went, says so


def test_a_prefix_the_decode_node_lacks_is_sent_in_full(delta_nodes, expected):
    prefill, decode = delta_nodes["prefills"][("streamed", "none")], delta_nodes["decode"]

    async def go():
        async with driver(delta_nodes["nodes"], prefill, decode) as link_driver:
            await link_driver.generate("warm-base", BASE, 2)  # the decode node holds BASE's chunks
            unheld = await generate_measured(prefill, link_driver, "unheld",
                                             prompt_of(1985, 99), HELD)
            # Held, but one token short of a cell's end: no grid resumes there exactly (whole
            # cells; an any-token grid wants >= 8 rows in the first forward; reuse_probe.py).
            unaligned = await generate_measured(prefill, link_driver, "unaligned",
                                                case_prompt(255), 1727)
            return unheld, unaligned

    before = counter(prefill, "mlxcel:handoff_prefix_missing_total")
    (unheld, unheld_bytes), (unaligned, unaligned_bytes) = run(go())
    assert unheld == expected["unheld"] and unaligned == expected["miss255"]
    assert counter(prefill, "mlxcel:handoff_prefix_missing_total") - before == 2
    # The retry carried the whole cache (the refused delta's begin went out too).
    assert unheld_bytes >= KV_BYTES_PER_TOKEN * 1985
    assert unaligned_bytes >= KV_BYTES_PER_TOKEN * len(case_prompt(255))
    refusals = 'mlxcel:kv_handoff_refusals_total{code="prefix_missing"}'
    assert counter(decode, refusals) >= 2
