"""Descriptions docs/reference.md needs where the code has none at the definition.

Kept in one place: an environment variable read outside ``mlxcel_plugin/config.py``
(whose ``ENV_VARS`` map each to a flag) must have a line here, or the reference
check fails and names it. A TOML key or endpoint described in the code (a field
comment, an OpenAPI summary, a handler docstring) takes that description; these
fill the gaps.
"""

from __future__ import annotations

ENV_DESCRIPTIONS = {
    "MLXCEL_CLUSTER_SECRET_FILE": "the cluster secret's file, when `--cluster-secret-file` is "
    "not given (prefill, decode, router; also the LiteLLM provider)",
    "MLXCEL_CLUSTER_SECRET": "the cluster secret itself (hex, or raw bytes; at least 16 bytes), "
    "when neither `--cluster-secret-file` nor `MLXCEL_CLUSTER_SECRET_FILE` is set",
    "MLXCEL_DECODE_ALLOWLIST": "comma-separated `host:port` decode targets a prefill node accepts "
    "from the router; unset: any. On the router, a decode node found by discovery outside the "
    "list is refused. A malformed entry is a start-up error ([security](security.md))",
    "MLXCEL_ROUTER_STATS_VERBOSE": "`1` shows peer addresses in `/router/stats` (redacted "
    "otherwise)",
    "MLXCEL_PLUGINS": "comma-separated entry-point names to load (an allow-list); unset: all",
    "MLXCEL_DISABLE_PLUGINS": "comma-separated entry-point names not to load",
    "MLXCEL_CACHE_DIR": "where converted models and the prefix-reuse probe's results live "
    "(default `~/.cache/mlxcel`)",
    "MLXCEL_NO_OPENBLAS": "`1`: engine nodes on Linux do not preload OpenBLAS for MLX "
    "([BLAS](blas.md))",
    "MLXCEL_OPENBLAS_CORETYPE": "opt-in: `auto` or a core type's name makes engine nodes set "
    "OpenBLAS's core type; unset or `keep` (default): `OPENBLAS_*` as the environment has "
    "them ([BLAS](blas.md): what each value means for the prefix cache and for correctness)",
    "MLXCEL_PROBE_CACHE_DIR": "where engine nodes keep the prefix-reuse probe's answers "
    "(default `$MLXCEL_CACHE_DIR/reuse-probe`, else `$XDG_CACHE_HOME/mlxcel/reuse-probe`, "
    "`~/.cache` when unset); a second start of the same node skips the probe "
    "([BLAS](blas.md))",
    "MLXCEL_NO_PROBE_CACHE": "`1`: engine nodes run the prefix-reuse probe at every start "
    "instead of keeping its answer",
    "MLXCEL_HUGE_PAGES": "`0` stops engine nodes asking Linux for transparent huge pages under "
    "received K/V (by default they ask: far fewer page faults per handoff)",
    "MLXCEL_RESPONSES_STORE_MAX_COUNT": "responses kept for `GET /v1/responses/{id}` and "
    "`previous_response_id` (default 1000; the least recently used go first; per router process)",
    "MLXCEL_RESPONSES_STORE_MAX_BYTES": "bytes those stored responses may take (default 64 MiB)",
    "MLXCEL_LOCUST_MODEL": "model name (default: the first id at `/v1/models`)",
    "MLXCEL_LOCUST_MAX_TOKENS": "`max_tokens` per request (default 64)",
    "MLXCEL_LOCUST_TEMPERATURE": "sampling temperature (default 0)",
    "MLXCEL_LOCUST_CHAT_WEIGHT": "weight of chat requests (default 3)",
    "MLXCEL_LOCUST_COMPLETION_WEIGHT": "weight of completion requests (default 1)",
    "MLXCEL_LOCUST_PROMPT_MIX": "prompt mix, e.g. `short:6,medium:3,long:1` (the default)",
    "MLXCEL_LOCUST_WAIT_S": "longest think time between a user's requests (default 0)",
    "MLXCEL_LOCUST_SEED": "prompt RNG seed (default 0; each user offsets it)",
    "MLXCEL_BULK_LANES": "bulk lanes (parallel encrypted TCP streams) a prefill node asks per "
    "link to a decode node, and the most a node grants a peer (1-16; default one per core up "
    "to 4): a handoff's bodies spread over them ([bulk lanes](bulk-lanes.md))",
}

# "section.key" -> description, for fields without a comment in their dataclass.
TOML_DESCRIPTIONS = {
    "engine.max_batch_size": "sequences stepped together by the engine",
    "engine.max_sequences": "sequences resident at once",
    "engine.memory_threshold": "share of the KV budget that active sequences may hold",
    "engine.kv_group_size": "group size of quantized K/V (with `kv_bits`)",
    "engine.warmup": "run a warmup pass at start-up (`--no-warmup` turns it off)",
    "prefill_scheduler.max_concurrent_prefills": "prompts prefilled at once",
    "prefill_scheduler.max_queue_size": "requests waiting for prefill before new ones are "
    "refused (at capacity)",
    "prefill_scheduler.chunked_prefill_enabled": "prefill in chunks of `chunk_size_tokens`",
    "prefill_scheduler.chunk_size_tokens": "prefill chunk; defaults to `[engine] "
    "chunk_size_tokens` (keep hybrid and prefill nodes alike: output is byte-identical only "
    "then)",
    "prefill_scheduler.aging_rate_tokens_per_s": "shorter prompts go first; a waiting prompt "
    "counts this many tokens shorter per second, so long prompts cannot starve",
    "prefill_scheduler.max_handoff_retries": "handoff attempts after the first before giving up",
    "prefill_scheduler.retry_after_s": "the `Retry-After` an at-capacity refusal carries",
    "decode_scheduler.ingestion_queue_size": "handoffs ingesting or waiting; beyond it prefill "
    "nodes are refused (backpressure) instead of buffering",
    "decode_scheduler.kv_budget_bytes": "KV every sequence reserves (prompt + `max_tokens`) from "
    "its handoff's start; defaults to `[engine] kv_memory_bytes` (the value shown is the "
    "fallback when neither is known); a handoff that does not fit is refused `at_capacity`",
    "decode_scheduler.retry_after_s": "the `Retry-After` an at-capacity refusal carries",
    "backpressure.moderate_utilization": "pool utilization (0..1) from which the load is "
    "moderate",
    "backpressure.high_utilization": "utilization from which the load is high",
    "backpressure.critical_utilization": "utilization from which the load is critical",
    "backpressure.moderate_action": "`admit`, `queue` or `reject` at moderate load",
    "backpressure.high_action": "`admit`, `queue` or `reject` at high load",
    "backpressure.critical_action": "`admit`, `queue` or `reject` at critical load (reject: "
    "HTTP 503 with `Retry-After`)",
    "backpressure.queue_max_size": "requests held in the admission queue at most",
    "backpressure.queue_timeout_s": "how long a queued request waits before a 503",
    "backpressure.retry_after_s": "the `Retry-After` of a 503",
    "backpressure.max_prompt_tokens": "longest prompt admitted",
    "health.interval_s": "each connected node is pinged this often",
    "health.reprobe_min_interval_s": "an unreachable prefill node is re-dialled at most this "
    "often before a request is refused",
    "health.reprobe_connect_timeout_s": "connect timeout of that re-dial",
    "discovery.kubernetes_selector": "label selector of the pods that are nodes",
    "discovery.kubernetes_role_label": "pod label holding the role (`prefill` or `decode`)",
    "node.telemetry_interval_s": "nodes send load reports to routers this often",
    "node.max_links": "links a node accepts at once",
}

# "METHOD path" or path -> description, for routes without an OpenAPI summary or a docstring.
ENDPOINT_DESCRIPTIONS = {
    "POST /v1/responses": "OpenAI Responses API: items, tools, `text.format`, typed stream "
    "events; stored for `previous_response_id`",
    "GET /v1/responses/{response_id}": "a stored response",
    "DELETE /v1/responses/{response_id}": "delete a stored response",
    "POST /v1/messages": "Anthropic Messages API (JSON or SSE stream)",
    "POST /v1/messages/count_tokens": "Anthropic's token count of a Messages request",
    "/openapi.json": "the OpenAPI schema: every endpoint's request and response models, the "
    "SSE chunk model `ChatCompletionChunk`",
    "/docs": "Swagger UI over `/openapi.json`",
    "/router/stats": "per-node dispatch counts, health, telemetry and prefix-cache figures, "
    "the router's prefix index, totals (migrations included), queue depths, and membership "
    "(discovery sources, draining nodes, the last changes); addresses redacted unless "
    "`MLXCEL_ROUTER_STATS_VERBOSE=1`",
    "/health/ready": "`{\"status\": \"ok\"}` when ready; 503 when not (router: no healthy "
    "node) and `{\"status\": \"draining\"}` from SIGTERM on",
    "/health/live": "`{\"status\": \"ok\"}` while the process serves, draining included",
    "/health": "readiness, as `/health/ready` (a node's JSON also carries its load)",
    "/metrics": "Prometheus metrics (below)",
}
# FastAPI's helper page for Swagger's OAuth flow: nothing of ours.
ENDPOINTS_NOT_LISTED = {"/docs/oauth2-redirect"}
