"""Multi-turn chat and agent conversations: how much prefix reuse saves, per server.

N conversations x T turns of two workloads, sent the same way to every server:

* ``chat``: a long shared system prompt (~1.3k SmolLM2 tokens of support
  policy), a per-conversation first message (the customer's situation), then
  short follow-up questions;
* ``agent``: a system prompt with the JSON schemas of eight tools (as agent
  frameworks send them), a per-conversation task, then tool results
  (``multiturn_workloads.py``).

Each turn appends the server's own reply (greedy, temperature 0) and the next
user message to that conversation's history, as a chat client does. Within a
turn the conversations go one at a time, round-robin (``--concurrent``: all
at once), so every other conversation's turn sits between two turns of one
conversation. Servers, one after another on the same checkpoint: ``mlx_lm``
(``mlx_lm.server``), ``hybrid-off`` / ``hybrid-on`` / ``hybrid-reuse`` (prefix
cache off, exact, ``reuse_generated = true``), ``cluster-off`` / ``cluster-on``
(router + one prefill + one decode node); ``cluster-reuse`` on request.

Per server, workload and turn it prints TTFT p50/p99, the cached share of the
prompt (``usage.prompt_tokens_details.cached_tokens``), the hit rate from
``/metrics`` (``mlxcel:prefix_cache_{hit,lookup}_tokens_total``), the KV bytes
the prefill node shipped (``mlxcel:handoff_bytes_sum``, over the handoffs acked,
``..._count``) against the prompt's full KV, the turns the router placed on a
decode node alone (``mlxcel:router_requests_total{outcome="local_prefills"}``:
no KV shipped, the decode node prefills the rest), and how many replies equal
the reference server's (``hybrid-off``; compared without leading/trailing
whitespace; once a reply differs, that conversation's later prompts differ
too); then throughput and the issue's targets. A figure a server does not
report reads ``n/a``.

    python loadtests/bench_multiturn.py [--quick] [--json PATH] [--model DIR]
        [--conversations 3] [--turns 5] [--max-tokens 24] [--servers a,b,...]
        [--workloads chat,agent] [--concurrent] [--deadline-s 900]

Default model: the embedded SmolLM2-135M; ``--quick``: the tiny test model,
2 conversations x 3 turns of short prompts (about half a minute, mostly start-ups, each
node forked from one process that imported its libraries: mlxcel_plugin/node_forkserver.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_common import (
    StreamResult,
    add_common_args,
    bench_result,
    discover_model,
    format_table,
    percentile,
    scrape_metrics,
    start_cluster,
    start_hybrid,
    start_mlx_lm_server,
    stream_request,
    table,
    write_json,
    write_toml_config,
)
from multiturn_workloads import Workload, make_workloads

from mlxcel_plugin import local_cluster

NA = "n/a"
START_TIMEOUT_S = 300.0
HIT = "mlxcel:prefix_cache_hit_tokens_total"
LOOKUP = "mlxcel:prefix_cache_lookup_tokens_total"
CACHED_BYTES = "mlxcel:prefix_cache_bytes"
EVICTIONS = "mlxcel:prefix_cache_evictions_total"
SHIPPED = "mlxcel:handoff_bytes_sum"
HANDOFFS = "mlxcel:handoff_bytes_count"  # handoffs acked: the ones SHIPPED counts
HANDOFF_METRICS = (SHIPPED, HANDOFFS)
ENGINE_METRICS = (HIT, LOOKUP, CACHED_BYTES, EVICTIONS)
# The router placed the request on a decode node alone (it prefills the missing part itself).
LOCAL_PREFILLS = 'mlxcel:router_requests_total{outcome="local_prefills"}'

# ------------------------------------------------------------------ servers


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server under test: its kind and its prefix-cache settings."""

    kind: str  # "mlx_lm", "hybrid" or "cluster"
    cache: str = "on"  # "off", "on" (exact) or "reuse" (reuse_generated = true)
    nodes_per_pool: int = 1  # cluster: prefill and decode nodes each
    balancer: str | None = None  # cluster: both pools' balancer (None: the default)
    chunk_tokens: int | None = None  # hybrid: [prefill_scheduler] chunk_size_tokens

    def node_args(self, workdir: Path) -> list[str]:
        balancer = self.balancer
        picks = ["--prefill-balancer", balancer, "--decode-balancer", balancer] if balancer else []
        if self.cache == "off":
            return ["--prefix-cache-bytes", "0", *picks]
        sections: dict[str, dict[str, Any]] = {}
        if self.cache == "reuse":
            sections["prefix_cache"] = {"reuse_generated": True}
        if self.chunk_tokens is not None:
            sections["prefill_scheduler"] = {"chunk_size_tokens": self.chunk_tokens}
        if sections:
            return [*write_toml_config(workdir / "prefix-cache.toml", sections), *picks]
        return picks


SERVERS = {
    "mlx_lm": ServerSpec("mlx_lm"),
    "hybrid-off": ServerSpec("hybrid", "off"),
    "hybrid-on": ServerSpec("hybrid", "on"),
    "hybrid-reuse": ServerSpec("hybrid", "reuse"),
    # The exact mode's trade: a smaller chunk recomputes less of the previous turn.
    "hybrid-on-c32": ServerSpec("hybrid", "on", chunk_tokens=32),
    "cluster-off": ServerSpec("cluster", "off"),
    "cluster-on": ServerSpec("cluster", "on"),
    "cluster-reuse": ServerSpec("cluster", "reuse"),
    # Two nodes per pool: does following the cached prefix beat spreading turns?
    "cluster2-rr": ServerSpec("cluster", "on", 2, "round-robin"),
    "cluster2-prefix": ServerSpec("cluster", "on", 2, "prefix-aware"),
}
DEFAULT_SERVERS = "mlx_lm,hybrid-off,hybrid-on,hybrid-reuse,cluster-off,cluster-on"


@dataclass(frozen=True)
class Endpoint:
    """A running server: where to send requests and which ``/metrics`` to read."""

    url: str
    model: str
    engine_urls: tuple[str, ...] = ()  # prefix-cache counters live here
    prefill_urls: tuple[str, ...] = ()  # handoff bytes live here
    router_urls: tuple[str, ...] = ()  # local prefills live here


@contextmanager
def serving(spec: ServerSpec, model: str, workdir: Path) -> Iterator[Endpoint]:
    """Start the server, yield its endpoint, stop it (by PID) afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    args = spec.node_args(workdir)
    if spec.kind == "cluster":
        cluster = start_cluster(model, workdir, START_TIMEOUT_S, args, spec.nodes_per_pool)
        try:
            engines = tuple(n.url for n in cluster.pool("prefill") + cluster.pool("decode"))
            prefill = tuple(n.url for n in cluster.pool("prefill"))
            router = cluster.router.url
            yield Endpoint(router, discover_model(router), engines, prefill, (router,))
        finally:
            cluster.stop()
        return
    hybrid = spec.kind == "hybrid"
    if hybrid:
        node = start_hybrid(model, workdir, START_TIMEOUT_S, args)
    else:
        node = start_mlx_lm_server(model, workdir, START_TIMEOUT_S)
    try:
        if hybrid:
            yield Endpoint(node.url, discover_model(node.url), (node.url,))
        else:  # mlx-lm serves its --model under the name "default_model"
            yield Endpoint(node.url, "default_model")
    finally:
        node.stop()


def kv_bytes_per_token(model: str) -> int | None:
    """Full (unencoded) K+V bytes one prompt token takes, from the checkpoint's config."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    layers, kv_heads = config.get("num_hidden_layers"), config.get("num_key_value_heads")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(config.get("torch_dtype"), 4)
    if not layers or not kv_heads:
        return None
    return 2 * layers * kv_heads * head_dim * dtype_bytes


# ------------------------------------------------------------------ conversations


@dataclass
class Conversation:
    index: int
    messages: list[dict[str, str]]
    alive: bool = True


@dataclass
class TurnRun:
    """One turn of every live conversation on one server, with /metrics around it."""

    server: str
    workload: str
    turn: int
    wall_s: float
    results: list[StreamResult]
    conversations: list[int]  # the conversation index of each result
    metrics_before: dict[str, float | None] = field(default_factory=dict)
    metrics_after: dict[str, float | None] = field(default_factory=dict)

    @property
    def ok(self) -> list[StreamResult]:
        return [result for result in self.results if result.ok]

    def delta(self, name: str) -> float | None:
        before, after = self.metrics_before.get(name), self.metrics_after.get(name)
        return None if before is None or after is None else after - before


def request_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


class Session:
    """Sends a workload's turns to one endpoint; every conversation keeps its own history."""

    def __init__(self, endpoint: Endpoint, client: httpx.Client, args: argparse.Namespace):
        self.endpoint, self.client, self.args = endpoint, client, args

    def send(self, conversation: Conversation) -> StreamResult:
        body = request_body(self.endpoint.model, conversation.messages, self.args.max_tokens)
        return stream_request(self.client, self.endpoint.url, "chat", "/v1/chat/completions", body)

    def scrape(self) -> dict[str, float | None]:
        engine = scrape_metrics(self.client, self.endpoint.engine_urls, ENGINE_METRICS)
        handoffs = scrape_metrics(self.client, self.endpoint.prefill_urls, HANDOFF_METRICS)
        local = scrape_metrics(self.client, self.endpoint.router_urls, (LOCAL_PREFILLS,))
        return engine | handoffs | local

    def run_turn(self, live: list[Conversation]) -> tuple[float, list[StreamResult]]:
        start = time.perf_counter()
        if self.args.concurrent:
            with ThreadPoolExecutor(max_workers=len(live)) as pool:
                results = list(pool.map(self.send, live))
        else:
            results = [self.send(conversation) for conversation in live]
        return time.perf_counter() - start, results

    def run(self, server: str, workload: Workload, deadline: float) -> list[TurnRun]:
        conversations = [
            Conversation(index, [{"role": "system", "content": workload.system}])
            for index in range(self.args.conversations)
        ]
        runs = []
        for turn in range(1, self.args.turns + 1):
            live = [c for c in conversations if c.alive]
            if not live or time.monotonic() > deadline:
                break
            for conversation in live:
                message = workload.user_message(conversation.index, turn)
                conversation.messages.append({"role": "user", "content": message})
            before = self.scrape()
            wall_s, results = self.run_turn(live)
            runs.append(TurnRun(server, workload.name, turn, wall_s, results,
                                [c.index for c in live], before, self.scrape()))  # fmt: skip
            ttft = ttft_ms([r for r in results if r.ok], 50) or float("nan")
            print(f"  [{server}] {workload.name} turn {turn}: {len(results)} requests in "
                  f"{wall_s:.1f} s, TTFT p50 {ttft:.0f} ms", flush=True)  # fmt: skip
            for conversation, result in zip(live, results, strict=True):
                report_failure(server, workload.name, turn, result)
                conversation.alive = result.ok
                conversation.messages.append({"role": "assistant", "content": result.text})
        return runs


def report_failure(server: str, workload: str, turn: int, result: StreamResult) -> None:
    if not result.ok:
        print(f"  {server} {workload} turn {turn}: request failed: {result.error}",
              file=sys.stderr)  # fmt: skip


def warm_up(session: Session) -> None:
    """One short unrelated request, so start-up costs do not land on turn 1."""
    conversation = Conversation(-1, [{"role": "user", "content": "Say hello."}])
    result = session.send(conversation)
    if not result.ok:
        raise RuntimeError(f"warm-up request failed: {result.error}")


def bench_server(
    name: str, workloads: list[Workload], args: argparse.Namespace, workdir: Path
) -> list[TurnRun]:
    print(f"[{name}] starting", flush=True)
    with serving(SERVERS[name], args.model, workdir / name) as endpoint:
        with httpx.Client(timeout=args.request_timeout_s) as client:
            session = Session(endpoint, client, args)
            warm_up(session)
            deadline = time.monotonic() + args.deadline_s
            runs = [run for w in workloads for run in session.run(name, w, deadline)]
    print(f"[{name}] {sum(len(r.results) for r in runs)} requests", flush=True)
    return runs


# ------------------------------------------------------------------ figures


def figure(value: float | None, digits: int = 1) -> float | str:
    """A rounded number, or ``n/a`` for a figure the server did not report."""
    if value is None or value != value:  # None or NaN
        return NA
    return round(value, digits)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def ttft_ms(results: Sequence[StreamResult], q: float) -> float | None:
    values = [r.ttft_s for r in results if r.ttft_s is not None]
    return 1e3 * percentile(values, q) if values else None


def prompt_tokens(results: Sequence[StreamResult]) -> int | None:
    counts = [r.prompt_tokens for r in results]
    return sum(counts) if counts and None not in counts else None  # type: ignore[arg-type]


def cached_share(results: Sequence[StreamResult]) -> float | None:
    """Cached prompt tokens / prompt tokens, from usage; None unless every reply says."""
    cached = [r.cached_tokens for r in results]
    if not cached or None in cached:
        return None
    return ratio(sum(cached), prompt_tokens(results))  # type: ignore[arg-type]


def full_kv_bytes(results: Sequence[StreamResult], per_token: int | None) -> float | None:
    tokens = prompt_tokens(results)
    return None if tokens is None or per_token is None else float(tokens * per_token)


@dataclass
class Figures:
    """Everything the tables show, computed once from the runs."""

    runs: list[TurnRun]
    reference: str
    kv_per_token: int | None

    def select(self, server: str, workload: str, from_turn: int = 1) -> list[TurnRun]:
        return [
            r
            for r in self.runs
            if r.server == server and r.workload == workload and r.turn >= from_turn
        ]

    def same_replies(self, run: TurnRun) -> str:
        reference = {
            (ref.turn, index): result.text.strip()
            for ref in self.select(self.reference, run.workload)
            for index, result in zip(ref.conversations, ref.results, strict=True)
        }
        # Stripped: mlx_lm.server drops the reply's leading space, our servers stream it.
        pairs = [(reference.get((run.turn, i)), r.text.strip())
                 for i, r in zip(run.conversations, run.results, strict=True)]  # fmt: skip
        known = [(ref, text) for ref, text in pairs if ref is not None]
        return f"{sum(ref == text for ref, text in known)}/{len(known)}" if known else NA

    def turn_row(self, run: TurnRun) -> list[Any]:
        ok = run.ok
        shipped = run.delta(SHIPPED)
        return [
            run.server, run.turn, f"{len(ok)}/{len(run.results)}",
            figure(ttft_ms(ok, 50)), figure(ttft_ms(ok, 99)),
            figure(ratio(prompt_tokens(ok), len(ok)), 0),
            figure(percent(cached_share(ok))),
            figure(percent(ratio(run.delta(HIT), run.delta(LOOKUP)))),
            figure(run.delta(HANDOFFS), 0),
            figure(run.delta(LOCAL_PREFILLS), 0),
            figure(ratio(shipped, len(ok) * 2**20), 2),
            figure(ratio(shipped, full_kv_bytes(ok, self.kv_per_token)), 3),
            self.same_replies(run),
        ]  # fmt: skip

    def late_ttft_ms(self, server: str, workload: str, from_turn: int = 2) -> float | None:
        results = [r for run in self.select(server, workload, from_turn) for r in run.ok]
        return ttft_ms(results, 50)

    def shipped_share(self, server: str, workload: str, from_turn: int = 3) -> float | None:
        runs = self.select(server, workload, from_turn)
        shipped = [run.delta(SHIPPED) for run in runs]
        full = [full_kv_bytes(run.ok, self.kv_per_token) for run in runs]
        if not runs or None in shipped or None in full:
            return None
        return ratio(sum(shipped), sum(full))  # type: ignore[arg-type]

    def throughput_row(self, server: str, workload: str) -> list[Any]:
        runs = self.select(server, workload)
        results = [r for run in runs for r in run.results]
        ok = [r for r in results if r.ok]
        wall_s = sum(run.wall_s for run in runs)
        last = runs[-1].metrics_after if runs else {}
        evictions = [run.delta(EVICTIONS) for run in runs]
        return [
            server, workload, len(ok), len(results) - len(ok), figure(wall_s),
            figure(ratio(sum(r.completion_tokens for r in ok), wall_s)),
            figure(ratio(len(ok), wall_s), 3),
            figure(ratio(last.get(CACHED_BYTES), 2**20)),
            figure(sum(evictions) if evictions and None not in evictions else None, 0),  # type: ignore[arg-type]
        ]  # fmt: skip


def percent(share: float | None) -> float | None:
    return None if share is None else 100.0 * share


TURN_COLUMNS = [
    "server", "turn", "ok", "TTFT p50 ms", "TTFT p99 ms", "prompt tok", "cached % (usage)",
    "hit % (/metrics)", "handoffs", "local prefills", "KV shipped MiB/req", "shipped / full KV",
    "replies = REF",
]  # fmt: skip
THROUGHPUT_COLUMNS = [
    "server", "workload", "requests", "errors", "wall s", "output tok/s", "requests/s",
    "prefix cache MiB", "evictions",
]  # fmt: skip
# (what, numerator server, denominator server or None for the shipped share, target)
TARGETS = (
    ("turns>=2 TTFT p50, hybrid-on / hybrid-off", "hybrid-on", "hybrid-off", 0.2),
    ("turns>=2 TTFT p50, cluster-on / cluster-off", "cluster-on", "cluster-off", 0.2),
    ("turns>=2 TTFT p50, hybrid-on / mlx_lm", "hybrid-on", "mlx_lm", 1.5),
    ("turns>=2 TTFT p50, hybrid-reuse / mlx_lm", "hybrid-reuse", "mlx_lm", 1.0),
    ("turns>=2 TTFT p50, hybrid-on-c32 / mlx_lm", "hybrid-on-c32", "mlx_lm", 1.5),
    ("turns>=2 TTFT p50, cluster-on / hybrid-on", "cluster-on", "hybrid-on", 1.3),
    ("turns>=2 TTFT p50, cluster-reuse / hybrid-reuse", "cluster-reuse", "hybrid-reuse", 1.3),
    ("turns>=3 KV shipped / full KV, cluster-on", "cluster-on", None, 0.10),
    ("turns>=3 KV shipped / full KV, cluster-reuse", "cluster-reuse", None, 0.10),
)


def target_rows(figures: Figures, workload: str, servers: Sequence[str]) -> list[list[Any]]:
    rows = []
    for what, server, base, target in TARGETS:
        if server not in servers or (base is not None and base not in servers):
            continue
        if base is None:
            value = figures.shipped_share(server, workload)
        else:
            value = ratio(figures.late_ttft_ms(server, workload),
                          figures.late_ttft_ms(base, workload))  # fmt: skip
        met = NA if value is None else ("yes" if value <= target else "no")
        rows.append([workload, what, figure(value, 3), f"<= {target}", met])
    return rows


def build_tables(figures: Figures, args: argparse.Namespace) -> list[dict[str, Any]]:
    shape = (f"{args.conversations} conversations x {args.turns} turns, {args.max_tokens} "
             f"output tokens, {'concurrent' if args.concurrent else 'round-robin'}")  # fmt: skip
    tables = []
    for workload in args.workloads:
        rows = [figures.turn_row(run) for s in args.servers
                for run in figures.select(s, workload)]  # fmt: skip
        columns = [c.replace("REF", figures.reference) for c in TURN_COLUMNS]
        tables.append(table(f"{workload} workload per turn ({shape})", columns, rows))
    pivot = [[s, w, *(figure(ttft_ms(run.ok, 50)) for run in figures.select(s, w))]
             for w in args.workloads for s in args.servers]  # fmt: skip
    turns = [f"turn {t}" for t in range(1, args.turns + 1)]
    width = 2 + args.turns
    pivot = [row + [NA] * (width - len(row)) for row in pivot]
    tables.append(table("TTFT p50 ms per turn", ["server", "workload", *turns], pivot))
    throughput = [figures.throughput_row(s, w) for w in args.workloads for s in args.servers]
    tables.append(table("Throughput per server and workload", THROUGHPUT_COLUMNS, throughput))
    targets = [row for w in args.workloads for row in target_rows(figures, w, args.servers)]
    columns = ["workload", "check", "value", "target", "met"]
    tables.append(table("Targets (issue 17)", columns, targets))
    return tables


def series_and_plot(figures: Figures, args: argparse.Namespace) -> tuple[dict, dict]:
    series: dict[str, list[float]] = {"turn": list(range(1, args.turns + 1))}
    for workload in args.workloads:
        for server in args.servers:
            values = [ttft_ms(run.ok, 50) for run in figures.select(server, workload)]
            series[f"{workload}_{server}_ttft_p50_ms"] = [
                float("nan") if v is None else round(v, 1) for v in values
            ]
    first = args.workloads[0]
    plot = {"x": "turn", "y": [f"{first}_{s}_ttft_p50_ms" for s in args.servers],
            "title": f"TTFT p50 per turn, {first} workload", "xlabel": "turn",
            "ylabel": "ms", "logx": False}  # fmt: skip
    return series, plot


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--model", help="checkpoint dir (default: SmolLM2; --quick: tiny)")
    parser.add_argument("--conversations", type=int, default=0, help="N (3; --quick 2)")
    parser.add_argument("--turns", type=int, default=0, help="T turns each (5; --quick 3)")
    parser.add_argument("--max-tokens", type=int, default=0, help="per reply (24; --quick 8)")
    parser.add_argument(
        "--servers",
        default=DEFAULT_SERVERS,
        help=f"comma-separated, run in order; known: {', '.join(SERVERS)}",
    )
    parser.add_argument("--workloads", default="chat,agent", help="chat, agent or both")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="send a turn's requests at once (default: one at a time)",
    )
    parser.add_argument(
        "--deadline-s", type=float, default=900.0, help="per server: no new turn starts after this"
    )
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--workdir", type=Path, help="keep server logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    args.conversations = args.conversations or (2 if args.quick else 3)
    args.turns = args.turns or (3 if args.quick else 5)
    args.max_tokens = args.max_tokens or (8 if args.quick else 24)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.servers) - set(SERVERS))
    if unknown:
        parser.error(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(SERVERS)}")
    return args


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from engines.model_store import ensure_default_model, ensure_tiny_model

    return str(ensure_tiny_model() if args.quick else ensure_default_model())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.model = resolve_model(args)
    if args.quick:  # a smoke run is mostly start-ups: fork the nodes (~1 CPU-s each, not ~3)
        local_cluster.fork_nodes()
    workloads = make_workloads(args.workloads, args.conversations, args.quick)
    runs: list[TurnRun] = []
    with tempfile.TemporaryDirectory(prefix="bench-multiturn-") as temp:
        for server in args.servers:
            runs += bench_server(server, workloads, args, args.workdir or Path(temp))
    reference = "hybrid-off" if "hybrid-off" in args.servers else args.servers[0]
    figures = Figures(runs, reference, kv_bytes_per_token(args.model))
    tables = build_tables(figures, args)
    for result_table in tables:
        print("\n" + format_table(result_table))
    print("\nn/a: not reported by that server. Full KV = prompt tokens x "
          f"{figures.kv_per_token} bytes (unencoded K+V of every layer).")  # fmt: skip
    if args.json:
        series, plot = series_and_plot(figures, args)
        write_json(args.json, bench_result("multiturn", tables, series, plot))


if __name__ == "__main__":
    main()
