"""Shared helpers for the load tests and the ``loadtests/bench_*.py`` benchmarks.

Benchmark script convention (``loadtests/report.py`` relies on it)
------------------------------------------------------------------
* A benchmark is a script ``loadtests/bench_<topic>.py`` runnable as
  ``python loadtests/bench_<topic>.py [--quick] [--json PATH]``; it prints its
  figures in human-readable form and exits 0 on success.
* ``--quick`` (optional; ``report.py`` passes it only when the script's source
  mentions ``--quick``) keeps the run to well under a minute.
* Given ``--json PATH`` it also writes one JSON object::

      {
        "name": "link",                                 # short topic name
        "tables": [{"title": str, "columns": [str, ...], "rows": [[cell, ...], ...]}],
        "series": {"raw_tcp_gib_s": [2.4, 2.5], "size_mib": [1, 4]},   # numbers only
        "plot": {"x": "size_mib", "y": ["raw_tcp_gib_s", "link_gib_s"],  # optional
                 "title": str, "xlabel": str, "ylabel": str, "logx": bool},
        "machine": machine_info(),
      }

  ``bench_result()`` builds it and ``write_json()`` writes it. ``report.py`` turns
  every table into a Markdown table and every ``plot`` into a PNG (a benchmark
  without ``plot`` gets one line per series against the sample index).

Streaming measurements
----------------------
``StreamRecorder`` is a sans-I/O parser of an OpenAI SSE stream: fed lines and
timestamps, it yields TTFT, inter-token gaps, end-to-end time and token counts,
and names what was wrong with a malformed stream. ``stream_request()`` drives it
with httpx; the locustfile drives it with locust's own client.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx
    from prompts import Prompt

    from mlxcel_plugin.local_cluster import LocalCluster, NodeProcess

LOOPBACK = "127.0.0.1"
DONE_SENTINEL = "[DONE]"


# --------------------------------------------------------------------------- stats


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {
        "count": float(len(values)),
        "mean": sum(values) / len(values) if values else math.nan,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


# ------------------------------------------------------------------ machine + JSON


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare figures across machines (no MLX import)."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "locust": _version("locust"),
        "openblas": _openblas(),
    }


def _openblas() -> str:
    """The BLAS our engine nodes preload (docs/design.md: ~25x faster CPU matmuls)."""
    from mlxcel_plugin import openblas

    if not sys.platform.startswith("linux"):
        return "n/a (not Linux)"
    return openblas.find_openblas() or "not found: MLX uses its reference BLAS"


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> dict[str, Any]:
    return {"title": title, "columns": list(columns), "rows": [list(row) for row in rows]}


def format_table(result_table: dict[str, Any]) -> str:
    """A ``table()`` as aligned plain text (title, header, rows) for a benchmark's printout."""
    columns = [str(column) for column in result_table["columns"]]
    rows = [[str(cell) for cell in row] for row in result_table["rows"]]
    widths = [max(len(line[i]) for line in [columns, *rows]) for i in range(len(columns))]
    lines = [result_table["title"]]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True))
              for line in [columns, *rows]]  # fmt: skip
    return "\n".join(lines)


def bench_result(
    name: str,
    tables: Sequence[dict[str, Any]] = (),
    series: dict[str, Sequence[float]] | None = None,
    plot: dict[str, Any] | None = None,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "name": name,
        "tables": list(tables),
        "series": {key: list(values) for key, values in (series or {}).items()},
        "machine": machine_info(),
    }
    if plot:
        result["plot"] = plot
    return result


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The two flags every benchmark script takes."""
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write figures as JSON")
    parser.add_argument("--quick", action="store_true", help="short run (seconds, tiny model)")
    return parser


def _jsonable(value: Any) -> Any:
    """NaN/inf are not JSON: a missing figure becomes null; paths become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(result), indent=2, allow_nan=False) + "\n")


# ------------------------------------------------------------- SSE measurement


@dataclass
class StreamResult:
    """One streamed request, timed from just before it was sent."""

    kind: str
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""  # the streamed content, joined (what a chat client appends to its history)
    usage: dict[str, Any] | None = None

    @property
    def cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field) if the server sent it."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return int(cached) if cached is not None else None

    @property
    def itl_s(self) -> list[float]:
        """Gaps between content chunks (one chunk usually carries one token)."""
        times = self.token_times_s
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, from the server's own token count."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.e2e_s if self.e2e_s > 0 else 0.0


def _chunk_text(choice: dict[str, Any]) -> str:
    # completions carry "text"; chat carries a delta (content, reasoning or tool calls).
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return text or ("<tool>" if delta.get("tool_calls") else "")


def _reply_text(choice: dict[str, Any]) -> str:
    """The answer's own text in a chunk (no reasoning, no tool-call marker)."""
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


@dataclass
class StreamRecorder:
    """Sans-I/O: feed SSE lines with their arrival time, then ``finish()``."""

    kind: str = "chat"
    token_times_s: list[float] = field(default_factory=list)
    first_finish_s: float | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False
    error: str | None = None
    content_chunks: int = 0
    text_parts: list[str] = field(default_factory=list)

    def feed(self, line: str, now_s: float) -> None:
        if self.error or not line or line.startswith(":"):
            return  # blank lines end events; ':' lines are SSE comments
        if not line.startswith("data:"):
            return  # event:/id:/retry: fields carry nothing we measure
        data = line[5:].strip()
        if self.done:
            self.error = "data after [DONE]"
        elif data == DONE_SENTINEL:
            self.done = True
        else:
            self._feed_json(data, now_s)

    def _feed_json(self, data: str, now_s: float) -> None:
        try:
            chunk = json.loads(data)
        except ValueError:
            self.error = f"malformed SSE data: {data[:80]!r}"
            return
        if not isinstance(chunk, dict):
            self.error = f"SSE data is not an object: {data[:80]!r}"
        elif "error" in chunk:
            self.error = f"error event: {json.dumps(chunk['error'])[:200]}"
        else:
            self._feed_chunk(chunk, now_s)

    def _feed_chunk(self, chunk: dict[str, Any], now_s: float) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if _chunk_text(choice):
                self.token_times_s.append(now_s)
                self.content_chunks += 1
            self.text_parts.append(_reply_text(choice))
            if choice.get("finish_reason") and self.finish_reason is None:
                self.finish_reason = choice["finish_reason"]
                self.first_finish_s = now_s

    def finish(self, e2e_s: float) -> StreamResult:
        error = self.error or self._completeness_error()
        usage = self.usage or {}
        first = self.token_times_s[0] if self.token_times_s else self.first_finish_s
        return StreamResult(
            kind=self.kind,
            ok=error is None,
            error=error,
            ttft_s=first,
            e2e_s=e2e_s,
            token_times_s=list(self.token_times_s),
            completion_tokens=int(usage.get("completion_tokens") or self.content_chunks),
            prompt_tokens=usage.get("prompt_tokens"),
            finish_reason=self.finish_reason,
            text="".join(self.text_parts),
            usage=self.usage,
        )

    def _completeness_error(self) -> str | None:
        if not self.done:
            return "stream ended without [DONE]"
        if self.finish_reason is None:
            return "stream had no finish_reason"
        return None


def failed(kind: str, error: str, e2e_s: float) -> StreamResult:
    return StreamResult(kind=kind, ok=False, error=error, e2e_s=e2e_s)


# ------------------------------------------------------------- request bodies


def request_for(
    kind: str, model: str, prompt: Prompt, max_tokens: int, temperature: float = 0.0
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of a streaming chat or completion request that asks for usage."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": prompt.messages()}
    if kind == "completion":
        return "/v1/completions", {**body, "prompt": prompt.text()}
    raise ValueError(f"unknown request kind {kind!r}; use 'chat' or 'completion'")


def stream_request(
    client: httpx.Client, base_url: str, kind: str, path: str, body: dict[str, Any]
) -> StreamResult:
    """POST one streaming request and time every SSE chunk as it arrives."""
    import httpx  # imported here so the locustfile (gevent) never pulls it in

    recorder = StreamRecorder(kind=kind)
    start = time.perf_counter()
    try:
        with client.stream("POST", base_url + path, json=body) as response:
            if response.status_code != 200:
                text = response.read().decode(errors="replace")[:200]
                return failed(kind, f"HTTP {response.status_code}: {text}", _since(start))
            for line in response.iter_lines():
                recorder.feed(line, _since(start))
    except httpx.HTTPError as exc:
        return failed(kind, f"{type(exc).__name__}: {exc}", _since(start))
    return recorder.finish(_since(start))


def _since(start: float) -> float:
    return time.perf_counter() - start


def discover_model(base_url: str, timeout_s: float = 5.0) -> str:
    """The first model id the server lists at /v1/models."""
    import httpx

    response = httpx.get(f"{base_url}/v1/models", timeout=timeout_s)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


# --------------------------------------------------------------- load loops


@dataclass
class LoadRun:
    concurrency: int
    wall_s: float
    results: list[StreamResult]

    @property
    def ok(self) -> list[StreamResult]:
        return [result for result in self.results if result.ok]


def run_closed_loop(
    send: Callable[[int], StreamResult],
    concurrency: int,
    max_requests: int,
    max_wall_s: float,
) -> LoadRun:
    """``concurrency`` workers call ``send(i)`` back to back; bounded in count and time."""
    lock = threading.Lock()
    next_index = iter(range(max_requests))
    deadline = time.monotonic() + max_wall_s
    results: list[StreamResult] = []

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            result = send(index)
            with lock:
                results.append(result)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    return LoadRun(concurrency, time.perf_counter() - start, results)


def goodput(run: LoadRun, slo_ttft_s: float, slo_tpot_s: float) -> float:
    """Requests per second that met both the TTFT and the TPOT objective."""
    good = [
        result
        for result in run.ok
        if result.ttft_s is not None
        and result.ttft_s <= slo_ttft_s
        and (result.tpot_s is None or result.tpot_s <= slo_tpot_s)
    ]
    return len(good) / run.wall_s if run.wall_s > 0 else 0.0


# --------------------------------------------------------------- servers


def start_hybrid(
    model: str, workdir: Path, timeout_s: float = 180.0, extra_args: Sequence[str] = ()
) -> NodeProcess:
    """One hybrid node on a free loopback port, healthy or raising with its log tail.

    ``extra_args``: more CLI flags, e.g. ``["--prefix-cache-bytes", "0"]``.
    """
    from mlxcel_plugin.local_cluster import start_node

    workdir.mkdir(parents=True, exist_ok=True)
    argv = ["--model", model, "--host", LOOPBACK, *extra_args]
    node = start_node("hybrid", workdir, argv)
    _wait_or_stop(node, timeout_s)
    return node


def start_cluster(
    model: str, workdir: Path, timeout_s: float = 300.0, extra_args: Sequence[str] = (),
    nodes_per_pool: int = 1,
) -> LocalCluster:
    """Router + ``nodes_per_pool`` prefill and decode nodes (stopped if one fails).

    ``extra_args``: more CLI flags for every node of the cluster, the router included.
    """
    from mlxcel_plugin.local_cluster import LocalCluster

    cluster = LocalCluster(workdir=workdir, model=model, common_args=list(extra_args),
                           prefill_count=nodes_per_pool, decode_count=nodes_per_pool)
    return cluster.start(timeout_s)


def write_toml_config(path: Path, sections: dict[str, dict[str, Any]]) -> list[str]:
    """Write ``--distributed-config`` TOML (flat sections of str/int/float/bool); its flags."""
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return ["--distributed-config", str(path)]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def start_mlx_lm_server(model: str, workdir: Path, timeout_s: float = 180.0,
                        extra_args: Sequence[str] = ()) -> NodeProcess:
    """mlx-lm's own server on the same checkpoint, with OpenBLAS like our engine nodes
    (``extra_args``: more of its flags, e.g. ``--draft-model PATH``)."""
    from mlxcel_plugin import openblas
    from mlxcel_plugin.local_cluster import NodeProcess, free_port

    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", model]
    argv += ["--host", LOOPBACK, "--port", str(port), "--log-level", "WARNING", *extra_args]
    env = openblas.preload_env(os.environ) or dict(os.environ)
    log_path = workdir / f"mlx_lm-{port}.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    node = NodeProcess("mlx_lm", port, None, log_path, process, argv)
    _wait_or_stop(node, timeout_s)
    return node


def _wait_or_stop(node: NodeProcess, timeout_s: float) -> None:
    try:
        node.wait_healthy(timeout_s)
    except BaseException:
        node.stop()
        raise


# --------------------------------------------------------------- Prometheus


def prometheus_value(exposition: str, name: str) -> float | None:
    """Sum of every sample called ``name`` (any labels) in Prometheus text; None if absent."""
    values = [_sample_value(line[len(name) :]) for line in exposition.splitlines()
              if line.startswith(name)]  # fmt: skip
    found = [value for value in values if value is not None]
    return sum(found) if found else None


def _sample_value(rest: str) -> float | None:
    """The value of a sample line after its name: ``{labels} value [ts]`` or `` value [ts]``."""
    if rest.startswith("{"):
        rest = rest[rest.rfind("}") + 1 :]
    elif not rest.startswith(" "):
        return None  # a longer name sharing the prefix (foo_sum vs foo)
    fields = rest.split()
    try:
        return float(fields[0]) if fields else None
    except ValueError:
        return None


def scrape_metrics(client: httpx.Client, urls: Iterable[str], names: Iterable[str]) -> dict:
    """``{name: sum over urls, or None}`` from each URL's ``/metrics`` (unreachable: absent)."""
    import httpx

    texts = []
    for url in urls:
        try:
            response = client.get(f"{url}/metrics")
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            texts.append(response.text)
    result: dict[str, float | None] = {}
    for name in names:
        values = [v for v in (prometheus_value(text, name) for text in texts) if v is not None]
        result[name] = sum(values) if values else None
    return result
