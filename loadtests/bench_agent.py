"""An agent conversation through /v1/responses and /v1/messages: TTFT per turn and cache share.

One 10-turn agent conversation per (server, API): a system prompt of >= 3k
SmolLM2 tokens (the JSON schemas of eight tools and an operations handbook),
a task, then turns whose user message is a tool result of 200-800 tokens, as
an agent sends them; each turn resends the whole history (OpenAI's
``store: false`` way, and Anthropic's), with the server's own reply (greedy)
appended. Servers, one after another on the same checkpoint: ``mlx_lm``
(``mlx_lm.server``, its chat endpoint: it serves neither agent API),
``hybrid`` and ``cluster`` (router + one prefill + one decode node,
prefix-aware balancers), each through ``responses`` and ``messages``. Each
(server, API) pair runs its own conversation (a task of its own), so no pair
reuses another's turns; the system prompt is shared, as it is in real use
(the warm-up request carries it too, so turn 1 finds it cached everywhere:
the figures that count are turns >= 2).

Per turn it prints TTFT (first text or thinking delta), prompt tokens and the
cached share (``cached_tokens``; ``cache_read_input_tokens``); then turns >= 2
TTFT p50 against ``mlx_lm``'s and the cached share of their prompt tokens,
with the issue's targets (<= 1.2x, >= 90%).

    python loadtests/bench_agent.py [--quick] [--json PATH] [--model DIR] [--turns 10]
        [--max-tokens 24] [--servers mlx_lm,hybrid,cluster] [--deadline-s 1800]

Default model: the embedded SmolLM2-135M; ``--quick``: the tiny test model,
3 turns of short prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_common import (
    add_common_args,
    bench_result,
    discover_model,
    format_table,
    percentile,
    start_cluster,
    start_hybrid,
    start_mlx_lm_server,
    table,
    write_json,
)
from multiturn_workloads import TOOLS, corpus_text, tool_schema

START_TIMEOUT_S = 300.0
APIS = {"mlx_lm": ("chat",), "hybrid": ("responses", "messages"),
        "cluster": ("responses", "messages")}  # fmt: skip
TARGET_TTFT_RATIO, TARGET_CACHED = 1.2, 0.90

# ------------------------------------------------------------------ the conversation


@dataclass(frozen=True)
class Script:
    system: str
    task: str
    tool_results: tuple[str, ...]  # one per turn after the first


def make_script(index: int, quick: bool, turns: int) -> Script:
    schemas = json.dumps([tool_schema(*tool) for tool in TOOLS], indent=2)
    handbook = corpus_text(random.Random(7), 60 if quick else 1500)
    system = ("You are an operations agent. To call a tool, answer with one JSON object "
              '{"tool": NAME, "arguments": {...}}; after the last tool result, answer in '
              f"plain text.\n\nAvailable tools:\n{schemas}\n\nHandbook:\n{handbook}")  # fmt: skip
    rng = random.Random(100 + index)
    low, high = (10, 30) if quick else (150, 330)  # words: ~200-450 tokens each
    results = tuple(
        f"Tool result ({TOOLS[t % len(TOOLS)][0]}): " + json.dumps(
            {"status": "ok", "result": corpus_text(rng, rng.randint(low, high))})
        for t in range(turns - 1)
    )  # fmt: skip
    task = f"Task {index}: customer {2000 + index} reports order A{7300 + index} is late."
    return Script(system, task, results)


# ------------------------------------------------------------------ one streamed turn


@dataclass
class Turn:
    ok: bool
    ttft_s: float | None = None
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


def request_for(api: str, model: str, script: Script, history: list[dict[str, str]],
                max_tokens: int) -> tuple[str, dict[str, Any]]:  # fmt: skip
    if api == "chat":
        messages = [{"role": "system", "content": script.system}, *history]
        return "/v1/chat/completions", {"model": model, "messages": messages, "stream": True,
                                        "max_tokens": max_tokens, "temperature": 0.0,
                                        "stream_options": {"include_usage": True}}  # fmt: skip
    if api == "responses":
        items = [{"type": "message", "role": m["role"], "content": m["content"]}
                 for m in history]  # fmt: skip
        return "/v1/responses", {"model": model, "instructions": script.system, "input": items,
                                 "stream": True, "store": False,
                                 "max_output_tokens": max_tokens}  # fmt: skip
    return "/v1/messages", {"model": model, "system": script.system, "messages": history,
                            "stream": True, "max_tokens": max_tokens}  # fmt: skip


def _feed(api: str, event: dict[str, Any], turn: Turn, now_s: float) -> None:
    """One SSE data object: text deltas (TTFT at the first), usage at the end."""
    text = ""
    if api == "chat":
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text += delta.get("content") or delta.get("reasoning_content") or ""
        usage = event.get("usage")
        if usage:
            turn.prompt_tokens = usage.get("prompt_tokens")
            turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    elif api == "responses":
        if event.get("type") in ("response.output_text.delta", "response.reasoning_text.delta"):
            text = event["delta"] if event["type"].startswith("response.output") else ""
            turn.ttft_s = turn.ttft_s if turn.ttft_s is not None else now_s
        elif event.get("type") in ("response.completed", "response.incomplete"):
            usage = event["response"]["usage"]
            turn.prompt_tokens = usage["input_tokens"]
            turn.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
    else:
        delta = event.get("delta") or {}
        if event.get("type") == "content_block_delta":
            text = delta.get("text") or ""
            turn.ttft_s = turn.ttft_s if turn.ttft_s is not None else now_s
        elif event.get("type") == "message_delta":
            usage = event["usage"]
            turn.cached_tokens = usage["cache_read_input_tokens"]
            turn.prompt_tokens = usage["input_tokens"] + turn.cached_tokens
    if event.get("type") in ("response.failed", "error"):  # an error after the stream began
        failure = event.get("response", {}).get("error") or event.get("error") or event
        turn.error = json.dumps(failure)[:300]
    if text and turn.ttft_s is None:
        turn.ttft_s = now_s
    turn.text += text


def send(client: httpx.Client, url: str, api: str, path: str, body: dict[str, Any]) -> Turn:
    turn, start = Turn(ok=False), time.perf_counter()
    try:
        with client.stream("POST", url + path, json=body) as response:
            if response.status_code != 200:
                turn.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return turn
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _feed(api, json.loads(line[6:]), turn, time.perf_counter() - start)
    except httpx.HTTPError as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
        return turn
    turn.ok = turn.prompt_tokens is not None and turn.error is None
    turn.error = turn.error or (None if turn.ok else "the stream carried no usage")
    return turn


def conversation(client: httpx.Client, url: str, model: str, api: str, script: Script,
                 args: argparse.Namespace, deadline: float) -> list[Turn]:  # fmt: skip
    history: list[dict[str, str]] = [{"role": "user", "content": script.task}]
    turns: list[Turn] = []
    for index in range(args.turns):
        if time.monotonic() > deadline:
            break
        path, body = request_for(api, model, script, history, args.max_tokens)
        turn = send(client, url, api, path, body)
        turns.append(turn)
        ttft = f"{1e3 * turn.ttft_s:.0f} ms" if turn.ttft_s is not None else "n/a"
        print(f"    turn {index + 1}: TTFT {ttft}, prompt {turn.prompt_tokens}, cached "
              f"{turn.cached_tokens}{'' if turn.ok else ', FAILED: ' + str(turn.error)}",
              flush=True)  # fmt: skip
        if not turn.ok or index + 1 >= args.turns:
            break
        history += [{"role": "assistant", "content": turn.text or "(no text)"},
                    {"role": "user", "content": script.tool_results[index]}]  # fmt: skip
    return turns


# ------------------------------------------------------------------ servers


@contextmanager
def serving(kind: str, model: str, workdir: Path) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of a started server; stopped (by PID) afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    if kind == "cluster":
        picks = ["--prefill-balancer", "prefix-aware", "--decode-balancer", "prefix-aware"]
        cluster = start_cluster(model, workdir, START_TIMEOUT_S, picks)
        try:
            yield cluster.router.url, discover_model(cluster.router.url)
        finally:
            cluster.stop()
        return
    if kind == "hybrid":
        node = start_hybrid(model, workdir, START_TIMEOUT_S)
    else:
        node = start_mlx_lm_server(model, workdir, START_TIMEOUT_S)
    try:  # mlx-lm serves its --model under the name "default_model"
        yield node.url, discover_model(node.url) if kind == "hybrid" else "default_model"
    finally:
        node.stop()


def bench_server(kind: str, args: argparse.Namespace, workdir: Path,
                 deadline: float) -> dict[str, list[Turn]]:  # fmt: skip
    runs = {}
    print(f"[{kind}] starting", flush=True)
    with serving(kind, args.model, workdir / kind) as (url, model):
        with httpx.Client(timeout=args.request_timeout_s) as client:
            send(client, url, APIS[kind][0], *request_for(  # warm-up, not counted
                APIS[kind][0], model, make_script(99, args.quick, 1),
                [{"role": "user", "content": "Say hello."}], 4))
            for api in APIS[kind]:
                print(f"  [{kind}] {api}", flush=True)
                script = make_script(len(runs) + 10 * len(APIS), args.quick, args.turns)
                runs[f"{kind}/{api}"] = conversation(client, url, model, api, script, args,
                                                     deadline)  # fmt: skip
    return runs


# ------------------------------------------------------------------ figures


def later(turns: list[Turn]) -> list[Turn]:
    return [t for t in turns[1:] if t.ok]


def ttft_p50_ms(turns: list[Turn]) -> float | None:
    values = [t.ttft_s for t in turns if t.ttft_s is not None]
    return 1e3 * percentile(values, 50) if values else None


def cached_share(turns: list[Turn]) -> float | None:
    prompt = sum(t.prompt_tokens or 0 for t in turns)
    cached = sum(t.cached_tokens or 0 for t in turns)
    return cached / prompt if prompt and all(t.cached_tokens is not None for t in turns) else None


def show(value: float | None, digits: int = 1) -> float | str:
    return "n/a" if value is None else round(value, digits)


def tables(runs: dict[str, list[Turn]]) -> list[dict[str, Any]]:
    per_turn = [[name, i + 1, show(1e3 * t.ttft_s if t.ttft_s is not None else None, 0),
                 t.prompt_tokens, t.cached_tokens,
                 show(100 * t.cached_tokens / t.prompt_tokens
                      if t.ok and t.cached_tokens is not None else None)]
                for name, turns in runs.items() for i, t in enumerate(turns)]  # fmt: skip
    baseline = ttft_p50_ms(later(runs.get("mlx_lm/chat", [])))
    summary = []
    for name, turns in runs.items():
        p50, share = ttft_p50_ms(later(turns)), cached_share(later(turns))
        ratio = p50 / baseline if p50 is not None and baseline else None
        meets = ("yes" if ratio is not None and ratio <= TARGET_TTFT_RATIO and share is not None
                 and share >= TARGET_CACHED else "no")  # fmt: skip
        summary.append([name, len(turns), show(p50, 0), show(ratio, 2),
                        show(100 * share if share is not None else None),
                        meets if name != "mlx_lm/chat" else "(baseline)"])  # fmt: skip
    return [
        table("per turn", ["server/api", "turn", "TTFT ms", "prompt tokens", "cached",
                           "cached %"], per_turn),
        table(f"turns >= 2 (targets: TTFT <= {TARGET_TTFT_RATIO}x mlx_lm, cached >= "
              f"{100 * TARGET_CACHED:.0f}%)", ["server/api", "turns", "TTFT p50 ms",
                                                "x mlx_lm", "cached %", "meets"], summary),
    ]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--model", help="checkpoint dir (default: SmolLM2; --quick: tiny)")
    parser.add_argument("--turns", type=int, default=None, help="10 (--quick: 3)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--servers", default="mlx_lm,hybrid,cluster")
    parser.add_argument("--deadline-s", type=float, default=1800.0)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    args.turns = args.turns or (3 if args.quick else 10)
    unknown = set(args.servers.split(",")) - set(APIS)
    if unknown:
        parser.error(f"unknown server(s) {sorted(unknown)}; known: {sorted(APIS)}")
    return args


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from engines.model_store import ensure_default_model, ensure_tiny_model

    return str(ensure_tiny_model() if args.quick else ensure_default_model())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.model = resolve_model(args)
    deadline = time.monotonic() + args.deadline_s
    runs: dict[str, list[Turn]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        for kind in args.servers.split(","):
            runs |= bench_server(kind, args, Path(tmp), deadline)
    result = bench_result("agent", tables(runs))
    for result_table in result["tables"]:
        print(format_table(result_table))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
