"""Run every benchmark plus a latency/goodput comparison and write a Markdown report.

    python loadtests/report.py [--out loadtests/results] [--quick] [--model DIR]
                               [--modes hybrid,cluster,mlx_lm]
                               [--no-benches | --benches link,kv_codecs]

* Every ``loadtests/bench_*.py`` runs with ``--json`` (and ``--quick`` where it
  takes one); see ``bench_common`` for the JSON convention.
* Latency: the same seeded prompt mix, one request at a time, against a hybrid
  node, a router + prefill + decode cluster (``LocalCluster``) and mlx-lm's own
  server on the same checkpoint -> TTFT / ITL / TPOT / E2E tables and CDF plots.
* Goodput: requests/s that meet both the TTFT and the TPOT objective as the
  number of concurrent clients rises (1, 2, 4, 8).

A mode that does not start is skipped with its reason in the report. ``--quick``
uses the tiny random checkpoint and stays within a few minutes; the default uses
the embedded SmolLM2-135M (converted once by ``engines.model_store``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_common as bc
from prompts import DEFAULT_MIX, parse_mix, sample_prompt

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODES = ("hybrid", "cluster", "mlx_lm")


@dataclass(frozen=True)
class Profile:
    """How much to run: ``--quick`` for minutes on the tiny model, the default for SmolLM2."""

    latency_requests: int
    max_tokens: int
    concurrency_levels: tuple[int, ...]
    goodput_requests_per_client: int
    level_wall_s: float
    slo_ttft_s: float
    slo_tpot_s: float
    bench_timeout_s: float
    start_timeout_s: float
    request_timeout_s: float


# Quick: the whole report within ~3 min on a busy 2-core box. Benches shorten
# themselves under --quick (2-30 s each; the timeout only stops one that
# overruns); a level normally ends in 0.5-5 s, so level_wall_s bounds a stalled
# server; the modes take ~35 s together.
QUICK = Profile(
    latency_requests=30,
    max_tokens=32,
    concurrency_levels=(1, 2, 4, 8),
    goodput_requests_per_client=4,
    level_wall_s=8.0,
    slo_ttft_s=0.5,
    slo_tpot_s=0.05,
    bench_timeout_s=45.0,
    start_timeout_s=120.0,
    request_timeout_s=60.0,
)
# SmolLM2 fp32 on a hybrid node here: TPOT ~70 ms, TTFT 0.25 s for a short chat
# and ~4 s for an 800-token document: looser objectives, fewer requests.
FULL = Profile(
    latency_requests=40,
    max_tokens=32,
    concurrency_levels=(1, 2, 4, 8),
    goodput_requests_per_client=4,
    level_wall_s=120.0,
    slo_ttft_s=5.0,
    slo_tpot_s=0.3,
    bench_timeout_s=600.0,
    start_timeout_s=300.0,
    request_timeout_s=300.0,
)


@dataclass
class ModeOutcome:
    name: str
    skipped: str | None = None
    latency: bc.LoadRun | None = None
    levels: list[bc.LoadRun] = field(default_factory=list)


@dataclass
class BenchOutcome:
    script: str
    ok: bool
    wall_s: float
    data: dict[str, Any] | None = None
    note: str = ""
    output: str = ""  # printed output, kept when there is no JSON to show


# ------------------------------------------------------------------ model + benches


def resolve_model(args: argparse.Namespace) -> str:
    """``--model`` if given, else the tiny (``--quick``) or the SmolLM2 checkpoint."""
    if args.model:
        return str(args.model)
    kind = "tiny" if args.quick else "smollm2"
    done = subprocess.run(
        [sys.executable, "-m", "engines.model_store", kind],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"could not prepare the {kind} model: {done.stderr.strip()[-500:]}")
    return lines[-1]


def bench_scripts(topics: str | None = None) -> list[Path]:
    """``bench_*.py`` scripts, optionally only ``topics`` (``"link,kv_codecs"``)."""
    wanted = {f"bench_{topic.strip()}" for topic in topics.split(",")} if topics else None
    # bench_common.py is the helpers module, not a benchmark.
    scripts = [p for p in HERE.glob("bench_*.py") if p.stem != "bench_common"]
    return sorted(p for p in scripts if wanted is None or p.stem in wanted)


def _takes(script: Path, flag: str) -> bool:
    # Read from the source, not --help: no extra start-up per script.
    source = script.read_text(errors="replace")
    return flag in source or "add_common_args" in source


def bench_argv(script: Path, json_path: Path, quick: bool) -> list[str]:
    argv = [sys.executable, str(script)]
    if _takes(script, "--json"):
        argv += ["--json", str(json_path)]
    if quick and _takes(script, "--quick"):
        argv.append("--quick")
    return argv


def run_bench(script: Path, out: Path, profile: Profile, quick: bool) -> BenchOutcome:
    """Run one benchmark; a script without ``--json`` still gets its printed output shown."""
    json_path = out / f"{script.stem}.json"
    log_path = out / f"{script.stem}.log"
    json_path.unlink(missing_ok=True)
    print(f"[bench] {script.name} ...", flush=True)
    start = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            done = subprocess.run(
                bench_argv(script, json_path, quick),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=profile.bench_timeout_s,
                check=False,
            )
        note = f"exit {done.returncode}" if done.returncode else ""
    except subprocess.TimeoutExpired:
        note = f"timed out after {profile.bench_timeout_s:.0f}s"
    wall_s = time.perf_counter() - start
    data = _read_json(json_path)
    if data is None and not note and _takes(script, "--json"):
        note = "wrote no JSON"
    print(f"[bench] {script.name}: {note or 'ok'} ({wall_s:.1f}s)", flush=True)
    output = "" if data else _tail(log_path, 40)
    return BenchOutcome(script.name, not note, wall_s, data, note, output)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        print(f"[bench] {path.name}: invalid JSON ({exc})", flush=True)
        return None


def _tail(path: Path, lines: int) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join(text.strip().splitlines()[-lines:])


# ------------------------------------------------------------------ servers + load


@contextmanager
def serving(mode: str, model: str, workdir: Path, timeout_s: float) -> Iterator[tuple[str, str]]:
    """Yield (base URL, model name) of a running server; stop it (by PID) afterwards."""
    if mode == "cluster":
        cluster = bc.start_cluster(model, workdir, timeout_s)
        try:
            yield cluster.router.url, bc.discover_model(cluster.router.url)
        finally:
            cluster.stop()
        return
    start = bc.start_hybrid if mode == "hybrid" else bc.start_mlx_lm_server
    node = start(model, workdir, timeout_s)
    try:
        # mlx-lm serves its --model under the name "default_model".
        yield node.url, "default_model" if mode == "mlx_lm" else bc.discover_model(node.url)
    finally:
        node.stop()


def make_sender(
    client: Any, url: str, model: str, max_tokens: int
) -> Callable[[int], bc.StreamResult]:
    """Request i is the same prompt and kind for every mode (seeded by i)."""
    mix = parse_mix(DEFAULT_MIX)

    def send(index: int) -> bc.StreamResult:
        prompt = sample_prompt(random.Random(index), mix)
        kind = "completion" if index % 4 == 3 else "chat"
        path, body = bc.request_for(kind, model, prompt, max_tokens)
        return bc.stream_request(client, url, kind, path, body)

    return send


def measure_mode(mode: str, model: str, out: Path, profile: Profile) -> ModeOutcome:
    import httpx

    print(f"[mode] {mode}: starting", flush=True)
    outcome = ModeOutcome(mode)
    try:
        with serving(mode, model, out / "servers" / mode, profile.start_timeout_s) as (url, name):
            limits = httpx.Limits(max_connections=max(profile.concurrency_levels) + 2)
            with httpx.Client(timeout=profile.request_timeout_s, limits=limits) as client:
                send = make_sender(client, url, name, profile.max_tokens)
                _measure(outcome, send, profile)
    except (RuntimeError, TimeoutError, OSError, ValueError, httpx.HTTPError) as exc:
        outcome.skipped = f"{type(exc).__name__}: {str(exc)[-600:]}"
    print(f"[mode] {mode}: {outcome.skipped or 'done'}", flush=True)
    return outcome


def _measure(outcome: ModeOutcome, send: Callable[[int], bc.StreamResult], p: Profile) -> None:
    warm = [send(10_000 + i) for i in range(2)]  # first requests pay one-off compile costs
    if not any(result.ok for result in warm):
        raise RuntimeError(f"warm-up requests failed: {warm[-1].error}")
    outcome.latency = bc.run_closed_loop(send, 1, p.latency_requests, p.level_wall_s * 2)
    _print_run(outcome.name, outcome.latency)
    for clients in p.concurrency_levels:
        count = clients * p.goodput_requests_per_client
        run = bc.run_closed_loop(send, clients, count, p.level_wall_s)
        outcome.levels.append(run)
        _print_run(outcome.name, run)


def _print_run(mode: str, run: bc.LoadRun) -> None:
    ttft = bc.summarize([r.ttft_s or 0.0 for r in run.ok])
    print(
        f"  {mode} c={run.concurrency}: {len(run.ok)}/{len(run.results)} ok in {run.wall_s:.1f}s,"
        f" TTFT p50 {ttft['p50'] * 1000:.0f} ms",
        flush=True,
    )


# ------------------------------------------------------------------ tables


def ms(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value * 1000:.1f}"


def latency_rows(outcomes: Sequence[ModeOutcome]) -> list[list[Any]]:
    rows = []
    for outcome in outcomes:
        if outcome.latency is None:
            continue
        ok = outcome.latency.ok
        ttft = bc.summarize([r.ttft_s for r in ok if r.ttft_s is not None])
        itl = bc.summarize([gap for r in ok for gap in r.itl_s])
        tpot = bc.summarize([r.tpot_s for r in ok if r.tpot_s is not None])
        e2e = bc.summarize([r.e2e_s for r in ok])
        tps = bc.summarize([r.tokens_per_s for r in ok])
        rows.append(
            [
                outcome.name,
                len(ok),
                len(outcome.latency.results) - len(ok),
                ms(ttft["p50"]),
                ms(ttft["p90"]),
                ms(ttft["p99"]),
                ms(itl["p50"]),
                ms(itl["p90"]),
                ms(itl["p99"]),
                ms(tpot["p50"]),
                ms(e2e["p50"]),
                f"{tps['mean']:.1f}",
            ]
        )
    return rows


LATENCY_COLUMNS = (
    "mode",
    "ok",
    "failed",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p90 ms",
    "ITL p99 ms",
    "TPOT p50 ms",
    "E2E p50 ms",
    "tokens/s",
)
GOODPUT_COLUMNS = (
    "mode",
    "clients",
    "ok/sent",
    "goodput req/s",
    "throughput req/s",
    "TTFT p90 ms",
    "TPOT p90 ms",
    "output tokens/s",
)


def goodput_rows(outcomes: Sequence[ModeOutcome], profile: Profile) -> list[list[Any]]:
    rows = []
    for outcome in outcomes:
        for run in outcome.levels:
            ok = run.ok
            tokens = sum(r.completion_tokens for r in ok)
            rows.append(
                [
                    outcome.name,
                    run.concurrency,
                    f"{len(ok)}/{len(run.results)}",
                    f"{bc.goodput(run, profile.slo_ttft_s, profile.slo_tpot_s):.2f}",
                    f"{len(ok) / run.wall_s:.2f}" if run.wall_s else "-",
                    ms(bc.percentile([r.ttft_s for r in ok if r.ttft_s is not None], 90)),
                    ms(bc.percentile([r.tpot_s for r in ok if r.tpot_s is not None], 90)),
                    f"{tokens / run.wall_s:.1f}" if run.wall_s else "-",
                ]
            )
    return rows


def first_errors(outcomes: Sequence[ModeOutcome]) -> list[str]:
    """One example error per mode that had failed requests (the report must say why)."""
    lines = []
    for outcome in outcomes:
        runs = [outcome.latency, *outcome.levels] if outcome.latency else outcome.levels
        errors = [r.error for run in runs for r in run.results if not r.ok]
        if errors:
            lines.append(f"* {outcome.name}: {len(errors)} failed, e.g. `{errors[0][:200]}`")
    return lines


def markdown_table(columns: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        text = "-" if value is None else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------ plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(path: Path, title: str, xlabel: str, data: dict[str, list[float]]) -> bool:
    data = {name: sorted(values) for name, values in data.items() if values}
    if not data:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, values in data.items():
        fractions = [(i + 1) / len(values) for i in range(len(values))]
        ax.step([v * 1000 for v in values], fractions, where="post", label=name)
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_goodput(path: Path, outcomes: Sequence[ModeOutcome], profile: Profile) -> bool:
    measured = [outcome for outcome in outcomes if outcome.levels]
    if not measured:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for outcome in measured:
        levels = [run.concurrency for run in outcome.levels]
        good = [bc.goodput(run, profile.slo_ttft_s, profile.slo_tpot_s) for run in outcome.levels]
        total = [len(run.ok) / run.wall_s for run in outcome.levels]
        (line,) = ax.plot(levels, good, marker="o", label=f"{outcome.name} goodput")
        ax.plot(
            levels,
            total,
            linestyle="--",
            color=line.get_color(),
            alpha=0.5,
            label=f"{outcome.name} throughput",
        )
    ax.set(
        title=f"Goodput (TTFT <= {profile.slo_ttft_s * 1000:.0f} ms, "
        f"TPOT <= {profile.slo_tpot_s * 1000:.0f} ms)",
        xlabel="concurrent clients",
        ylabel="requests/s",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(profile.concurrency_levels), [str(c) for c in profile.concurrency_levels])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_bench(path: Path, data: dict[str, Any]) -> bool:
    """A benchmark's ``plot`` spec, or every series against its index."""
    series: dict[str, list[float]] = data.get("series") or {}
    spec = data.get("plot") or {}
    names = spec.get("y") or [name for name in series if name != spec.get("x")]
    names = [name for name in names if series.get(name)]
    if not names:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name in names:
        xs = series.get(spec.get("x", ""), list(range(len(series[name]))))
        ax.plot(xs[: len(series[name])], series[name], marker="o", label=name)
    if spec.get("logx"):
        ax.set_xscale("log", base=2)
    ax.set(
        title=spec.get("title", data.get("name", path.stem)),
        xlabel=spec.get("xlabel", spec.get("x", "sample")),
        ylabel=spec.get("ylabel", ""),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ report


def machine_section(machine: dict[str, Any], model: str, profile: Profile, quick: bool) -> str:
    rows = [[key, value] for key, value in machine.items()]
    rows += [["model", model], ["profile", "quick" if quick else "full"]]
    rows += [["max_tokens", profile.max_tokens]]
    return "## Machine and run\n\n" + markdown_table(("", ""), rows)


def latency_section(outcomes: Sequence[ModeOutcome], out: Path, profile: Profile) -> str:
    parts = [
        "## Latency (one client, same prompt mix for every mode)",
        f"{profile.latency_requests} requests per mode, prompt mix `{DEFAULT_MIX}` "
        "(words), 3 chat : 1 completion, greedy, streamed with usage. ITL is the gap "
        "between content chunks; TPOT = (E2E - TTFT) / (completion tokens - 1).",
        markdown_table(LATENCY_COLUMNS, latency_rows(outcomes)),
    ]
    runs = {o.name: o.latency.ok for o in outcomes if o.latency}
    ttft = {name: [r.ttft_s for r in ok if r.ttft_s is not None] for name, ok in runs.items()}
    itl = {name: [gap for r in ok for gap in r.itl_s] for name, ok in runs.items()}
    if plot_cdfs(out / "ttft_cdf.png", "Time to first token", "TTFT (ms)", ttft):
        parts.append("![TTFT CDF](ttft_cdf.png)")
    if plot_cdfs(out / "itl_cdf.png", "Inter-token latency", "ITL (ms)", itl):
        parts.append("![ITL CDF](itl_cdf.png)")
    return "\n\n".join(parts)


def goodput_section(outcomes: Sequence[ModeOutcome], out: Path, profile: Profile) -> str:
    parts = [
        "## Goodput vs load",
        f"Closed loop, {profile.goodput_requests_per_client} requests per client per level "
        f"(at most {profile.level_wall_s:.0f} s a level). Goodput counts requests with "
        f"TTFT <= {profile.slo_ttft_s * 1000:.0f} ms and TPOT <= "
        f"{profile.slo_tpot_s * 1000:.0f} ms.",
        markdown_table(GOODPUT_COLUMNS, goodput_rows(outcomes, profile)),
    ]
    if plot_goodput(out / "goodput.png", outcomes, profile):
        parts.append("![goodput](goodput.png)")
    errors = first_errors(outcomes)
    if errors:
        parts.append("Failed requests:\n\n" + "\n".join(errors))
    skipped = [f"* {o.name}: skipped — {o.skipped}" for o in outcomes if o.skipped]
    if skipped:
        parts.append("Modes not measured:\n\n" + "\n".join(skipped))
    return "\n\n".join(parts)


def bench_section(benches: Sequence[BenchOutcome], out: Path) -> str:
    if not benches:
        return "## Benchmarks\n\nNo `loadtests/bench_*.py` scripts found (or `--no-benches`)."
    parts = ["## Benchmarks"]
    for bench in benches:
        status = "ok" if bench.ok else f"**failed**: {bench.note}"
        parts.append(f"### {bench.script}\n\n{status} ({bench.wall_s:.1f} s)")
        data = bench.data or {}
        for spec in data.get("tables") or []:
            title = spec.get("title", "")
            parts.append(f"**{title}**\n\n" + markdown_table(spec["columns"], spec["rows"]))
        if bench.output:
            parts.append(f"Output (last lines):\n\n```text\n{bench.output}\n```")
        png = f"{Path(bench.script).stem}.png"
        if data and plot_bench(out / png, data):
            parts.append(f"![{bench.script}]({png})")
    return "\n\n".join(parts)


def write_report(out: Path, sections: Sequence[str], command: str) -> Path:
    header = (
        "# mlxcel-plugin benchmark report\n\n"
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `{command}`."
    )
    path = out / "report.md"
    path.write_text("\n\n".join([header, *sections]) + "\n")
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    parser.add_argument("--quick", action="store_true", help="tiny model, a few minutes")
    parser.add_argument("--model", type=Path, help="checkpoint dir (default by profile)")
    parser.add_argument("--modes", default=",".join(MODES), help="subset of " + ",".join(MODES))
    parser.add_argument("--no-benches", action="store_true", help="skip bench_*.py scripts")
    parser.add_argument("--benches", help="only these bench topics, e.g. link,kv_codecs")
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    profile = QUICK if args.quick else FULL
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "servers", ignore_errors=True)
    model = resolve_model(args)
    print(f"model: {model}", flush=True)
    scripts = [] if args.no_benches else bench_scripts(args.benches)
    benches = [run_bench(script, out, profile, args.quick) for script in scripts]
    outcomes = [measure_mode(mode, model, out, profile) for mode in args.modes.split(",")]
    sections = [
        machine_section(bc.machine_info(), model, profile, args.quick),
        latency_section(outcomes, out, profile),
        goodput_section(outcomes, out, profile),
        bench_section(benches, out),
    ]
    command = "python loadtests/report.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"report: {write_report(out, sections, command.strip())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
