"""Locust load test: streaming OpenAI chat and completion requests with real latency figures.

Headless run against a hybrid node or a router (results in ``out/run_stats.csv``)::

    locust -f loadtests/locustfile.py --headless -u 8 -r 4 -t 30s \\
        --host http://127.0.0.1:8080 --csv out/run --stop-timeout 30

With ``stream=True`` locust's own timing stops at the response headers, so each
request is timed here and reported as extra rows of type ``METRIC`` (all in ms
except ``tokens_per_s``):

* ``TTFT``          time to the first content chunk
* ``ITL``           mean gap between content chunks of one request
* ``TPOT``          (E2E - TTFT) / (completion tokens - 1), from the server's usage
* ``E2E``           request start to ``[DONE]``
* ``tokens_per_s``  completion tokens / E2E in seconds, written in the
                    response-time columns; its content size column holds the tokens

The ``POST chat``/``POST completion`` rows carry E2E as their response time and
fail on an HTTP error, an error event, malformed SSE data, a missing
``finish_reason`` or a missing ``[DONE]``. The ``--stop-timeout`` lets in-flight
streams finish when the run ends instead of being cut off.

Environment (all optional):

======================================  ===========================================
``MLXCEL_LOCUST_MODEL``                 model name (default: first id at /v1/models)
``MLXCEL_LOCUST_MAX_TOKENS``            ``max_tokens`` per request (default 64)
``MLXCEL_LOCUST_TEMPERATURE``           sampling temperature (default 0.0)
``MLXCEL_LOCUST_CHAT_WEIGHT``           weight of chat requests (default 3)
``MLXCEL_LOCUST_COMPLETION_WEIGHT``     weight of completion requests (default 1)
``MLXCEL_LOCUST_PROMPT_MIX``            e.g. ``short:6,medium:3,long:1`` (the default)
``MLXCEL_LOCUST_WAIT_S``                max think time between requests (default 0)
``MLXCEL_LOCUST_SEED``                  prompt RNG seed (default 0; each user offsets it)
``MLXCEL_API_KEY``                      sent as ``Authorization: Bearer`` (the first key
                                        if comma-separated; the server's ``--api-key``)
======================================  ===========================================
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import time
from collections.abc import Iterator
from typing import Any

# bench_common and prompts are siblings: locust puts this file's directory on
# sys.path while importing it.
from bench_common import StreamRecorder, StreamResult, request_for
from locust import FastHttpUser, between, task
from locust.exception import StopUser
from prompts import DEFAULT_MIX, parse_mix, sample_prompt

MAX_TOKENS = int(os.environ.get("MLXCEL_LOCUST_MAX_TOKENS", "64"))
TEMPERATURE = float(os.environ.get("MLXCEL_LOCUST_TEMPERATURE", "0.0"))
CHAT_WEIGHT = int(os.environ.get("MLXCEL_LOCUST_CHAT_WEIGHT", "3"))
COMPLETION_WEIGHT = int(os.environ.get("MLXCEL_LOCUST_COMPLETION_WEIGHT", "1"))
PROMPT_MIX = parse_mix(os.environ.get("MLXCEL_LOCUST_PROMPT_MIX", DEFAULT_MIX))
WAIT_S = float(os.environ.get("MLXCEL_LOCUST_WAIT_S", "0"))
SEED = int(os.environ.get("MLXCEL_LOCUST_SEED", "0"))
# The server's own variable: a locust run on the server's machine needs no extra setting.
API_KEY = (os.environ.get("MLXCEL_API_KEY") or "").split(",")[0].strip()
AUTH = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}

METRIC = "METRIC"
_user_ids = itertools.count()


class StreamingUser(FastHttpUser):
    """One client in a closed loop: send a streaming request, read it to ``[DONE]``, repeat."""

    wait_time = between(0, WAIT_S)
    # Cached per process: every user would otherwise ask /v1/models on start.
    model_name: str | None = os.environ.get("MLXCEL_LOCUST_MODEL") or None

    def on_start(self) -> None:
        self.rng = random.Random(SEED * 1_000_003 + next(_user_ids))
        if StreamingUser.model_name is None:
            StreamingUser.model_name = self._discover_model()

    def _discover_model(self) -> str:
        with self.client.get("/v1/models", name="GET /v1/models", headers=AUTH,
                             catch_response=True) as resp:  # fmt: skip
            try:
                models = resp.json().get("data") or []
                return models[0]["id"]
            except (ValueError, TypeError, KeyError, IndexError):
                resp.failure(f"no model in /v1/models: {(resp.text or '')[:200]}")
                raise StopUser() from None

    @task(CHAT_WEIGHT)
    def chat(self) -> None:
        self._stream("chat")

    @task(COMPLETION_WEIGHT)
    def completion(self) -> None:
        self._stream("completion")

    def _stream(self, kind: str) -> None:
        prompt = sample_prompt(self.rng, PROMPT_MIX)
        path, body = request_for(kind, self.model_name or "", prompt, MAX_TOKENS, TEMPERATURE)
        # identity: a compressed SSE body could not be read line by line as it arrives.
        headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity", **AUTH}
        start = time.perf_counter()
        with self.client.post(
            path,
            data=json.dumps(body),
            headers={**headers, "Content-Type": "application/json"},
            name=f"POST {kind}",
            stream=True,
            catch_response=True,
        ) as resp:
            result = self._read_stream(resp, kind, start)
            # The POST row shows the whole stream, not just the time to headers.
            resp.request_meta["response_time"] = result.e2e_s * 1000
            resp.request_meta["response_length"] = result.completion_tokens
            if result.ok:
                resp.success()
            else:
                resp.failure(result.error)
        if result.ok:
            self._fire_metrics(result)

    def _read_stream(self, resp: Any, kind: str, start: float) -> StreamResult:
        recorder = StreamRecorder(kind=kind)
        if resp.status_code != 200:
            recorder.error = f"HTTP {resp.status_code}: {(resp.text or '')[:200]}"
            return recorder.finish(time.perf_counter() - start)
        try:
            for line in _sse_lines(resp):
                recorder.feed(line, time.perf_counter() - start)
        except (OSError, http.client.HTTPException) as exc:
            # A reset or timeout mid-stream is this request's failure, not a locust error.
            recorder.error = f"{type(exc).__name__} mid-stream: {exc}"
        return recorder.finish(time.perf_counter() - start)

    def _fire_metrics(self, result: StreamResult) -> None:
        gaps = result.itl_s
        figures_s = {
            "TTFT": result.ttft_s,
            "ITL": sum(gaps) / len(gaps) if gaps else None,
            "TPOT": result.tpot_s,
            "E2E": result.e2e_s,
        }
        for name, seconds in figures_s.items():
            if seconds is not None:
                self._fire(name, seconds * 1000, 0)
        self._fire("tokens_per_s", result.tokens_per_s, result.completion_tokens)

    def _fire(self, name: str, value: float, length: int) -> None:
        self.environment.events.request.fire(
            request_type=METRIC,
            name=name,
            response_time=value,
            response_length=length,
            exception=None,
            context={},
        )


def _sse_lines(resp: Any) -> Iterator[str]:
    """Yield decoded SSE lines as soon as each arrives.

    FastResponse.readline() splits on b"\\r\\n" and read(n) waits for n bytes, so
    neither gives per-token timing; geventhttpclient's own response object
    returns a line the moment its b"\\n" has arrived.
    """
    raw = getattr(resp, "_response", None)
    if raw is None or not hasattr(raw, "readline"):
        raise RuntimeError("this locust/geventhttpclient has no line-level stream reader")
    while line := raw.readline(b"\n"):
        yield line.decode("utf-8", errors="replace").rstrip("\r\n")
