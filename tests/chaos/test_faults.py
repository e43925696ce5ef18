"""Chaos: kill -9 and SIGSTOP of each role at each phase of a request, a cut link, a rolling
restart, on real processes (2 prefill + 2 decode fake-engine nodes, each behind a proxy).

The fake engine runs in its autoregressive mode, so a migrated stream has one right answer:
the no-fault output. Asserted for every fault a healthy pair survives: every stream ends with
that text and no error, within the stream deadline; the survivors' KV gauges return to 0; the
faulted node comes back and takes traffic. A router fault leaves no router: streams may fail,
but the nodes free every request and a restarted router serves again
(docs/cluster-flow.md, "Migration").
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.harness import STREAM_DEADLINE_S, ChaosCluster, Outcome, fake_model_dir

pytestmark = pytest.mark.timeout(600)

ROUTER_TOML = """
[router]
token_timeout_s = 2.0
[health]
interval_s = 0.25
ping_timeout_s = 0.5
"""
KNOBS = {"autoregressive": True, "decode_step_s": 0.005, "prefill_s_per_token": 0.002}
# Long prompts: ~0.5 s of prefill, so a fault 0.3 s in lands before the first token.
PROMPTS = [f"{'story ' * 250}number {i}" for i in range(6)]
MAX_TOKENS = 80
PHASES = ("before_first_token", "mid_handoff", "mid_stream")
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")


@pytest.fixture(scope="module")
def chaos(tiny_model_path: Path, tmp_path_factory) -> Iterator[ChaosCluster]:
    workdir = tmp_path_factory.mktemp("chaos")
    model = fake_model_dir(workdir / "model", tiny_model_path, **KNOBS)
    args = ["--engine", "fake", "--served-model-name", "tiny", "--no-warmup",
            "--prefill-balancer", "round-robin", "--decode-balancer", "round-robin"]
    cluster = ChaosCluster(workdir, model, args, ROUTER_TOML)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def baseline(chaos: ChaosCluster) -> dict[str, str]:
    """Each prompt's no-fault text."""
    outcomes = [f.result() for f in chaos.streams(PROMPTS, MAX_TOKENS)]
    assert all(o.ok for o in outcomes), outcomes
    return {p: o.text for p, o in zip(PROMPTS, outcomes, strict=True)}


def run_with_fault(chaos: ChaosCluster, phase: str, fault) -> list[Outcome]:
    """Start the streams, fire ``fault()`` at ``phase``, wait for every stream."""
    first_tokens = threading.Event()
    progress = {"chunks": 0}

    def on_tokens(chunks: int) -> None:
        progress["chunks"] = max(progress["chunks"], chunks)
        first_tokens.set()

    futures = chaos.streams(PROMPTS, MAX_TOKENS, on_tokens=on_tokens)
    if phase == "before_first_token":
        time.sleep(0.3)
    elif phase == "mid_handoff":
        first_tokens.wait(30)
    else:
        chaos.wait_until(lambda: progress["chunks"] >= 20)
    fault()
    return [f.result(timeout=120) for f in futures]


def assert_exact(chaos: ChaosCluster, outcomes: list[Outcome], baseline: dict[str, str],
                 prompts: list[str] = PROMPTS) -> None:
    for prompt, outcome in zip(prompts, outcomes, strict=True):
        # The router's log says why a stream failed (a CI run keeps no workdir).
        assert outcome.ok, (outcome, chaos.router.log_tail(60))
        assert outcome.elapsed_s < STREAM_DEADLINE_S  # no stream hung, whatever the fault
        assert outcome.text == baseline[prompt]


def assert_survivors_free(chaos: ChaosCluster, *, skip: str | None = None) -> None:
    for name in WORKERS:
        if name != skip:
            chaos.wait_until(lambda name=name: chaos.kv_bytes(name) == 0)


def again(chaos: ChaosCluster, baseline: dict[str, str]) -> None:
    """After a recovery: two fresh streams, exact."""
    outcomes = [f.result() for f in chaos.streams(PROMPTS[:2], MAX_TOKENS)]
    assert_exact(chaos, outcomes, baseline, PROMPTS[:2])


def counters(chaos: ChaosCluster) -> dict:
    return chaos.stats()["metrics"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("target", ["prefill-0", "decode-0"])
def test_kill_a_worker(chaos, baseline, target: str, phase: str) -> None:
    failed = counters(chaos)["failed"]
    try:
        outcomes = run_with_fault(chaos, phase, lambda: chaos.signal(target, signal.SIGKILL))
        assert_exact(chaos, outcomes, baseline)
        assert counters(chaos)["failed"] == failed
        assert_survivors_free(chaos, skip=target)
    finally:
        chaos.restart(target)  # whatever failed, the next test finds four nodes
    again(chaos, baseline)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("target", ["prefill-0", "decode-0"])
def test_stop_a_worker(chaos, baseline, target: str, phase: str) -> None:
    failed = counters(chaos)["failed"]
    try:
        outcomes = run_with_fault(chaos, phase, lambda: chaos.signal(target, signal.SIGSTOP))
        chaos.wait_until(lambda: chaos.node_entry(target)["health"] == "unreachable")
    finally:
        chaos.signal(target, signal.SIGCONT)
    assert_exact(chaos, outcomes, baseline)
    assert counters(chaos)["failed"] == failed
    # Woken, it hears its links were dropped, frees what it held, and is dialled again.
    assert_survivors_free(chaos)
    chaos.wait_until(lambda: chaos.node_entry(target)["health"] == "healthy")


def test_a_cut_link_migrates_and_heals(chaos, baseline) -> None:
    proxy = chaos.proxies["decode-0"]
    try:
        outcomes = run_with_fault(chaos, "mid_stream", proxy.cut)
    finally:
        proxy.heal()
    assert_exact(chaos, outcomes, baseline)
    assert counters(chaos)["migrated"] >= 1
    assert_survivors_free(chaos)
    chaos.wait_until(lambda: chaos.node_entry("decode-0")["health"] == "healthy")


@pytest.mark.parametrize("phase", PHASES)
def test_router_faults_free_the_nodes_and_a_new_router_serves(chaos, baseline,
                                                              phase: str) -> None:
    port = chaos.router.port
    try:
        run_with_fault(chaos, phase, lambda: chaos.signal("router", signal.SIGKILL))
        assert_survivors_free(chaos)
    finally:
        if chaos.router.process.poll() is None:  # failed before its fault: end it here
            chaos.signal("router", signal.SIGKILL)
        chaos.router.process.wait(10)
        chaos.start_router(port)  # whatever failed, the next test finds a router
    again(chaos, baseline)


def test_a_stopped_router_resumes_its_streams(chaos, baseline) -> None:
    def pause_router() -> None:
        chaos.signal("router", signal.SIGSTOP)
        time.sleep(1.0)
        chaos.signal("router", signal.SIGCONT)

    assert_exact(chaos, run_with_fault(chaos, "mid_stream", pause_router), baseline)


def test_rolling_restart_under_load(chaos, baseline) -> None:
    """Every worker restarted in turn while streams keep coming: none fails, all exact."""
    stop, outcomes = threading.Event(), []

    def load() -> None:
        while not stop.is_set():  # bounded: the test sets stop after the last restart
            outcomes.extend(f.result(timeout=120) for f in chaos.streams(PROMPTS[:4],
                                                                         MAX_TOKENS))

    driver = threading.Thread(target=load)
    driver.start()
    try:
        for name in WORKERS:
            time.sleep(0.5)
            chaos.signal(name, signal.SIGTERM)
            chaos.restart(name, exit_timeout_s=30.0)
    finally:
        stop.set()
        driver.join(180)
    assert len(outcomes) >= 8
    for i, outcome in enumerate(outcomes):
        assert outcome.ok, (outcome, chaos.router.log_tail(60))
        assert outcome.text == baseline[PROMPTS[i % 4]]
    assert_survivors_free(chaos)
