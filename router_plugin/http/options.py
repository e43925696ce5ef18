"""What the HTTP front enforces at its edge: API keys, body size, JSON depth.

Built from the server config (``--api-key``, ``--metrics-require-key``,
``--max-request-bytes``) by the hybrid and router roles; the defaults are
what ``make_app`` uses when given none (tests, the LiteLLM provider).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.config import DEFAULT_MAX_REQUEST_BYTES
from mlxcel_plugin.errors import ConfigError

# Real requests nest a few levels (messages -> content parts, tools -> JSON schema).
DEFAULT_MAX_JSON_DEPTH = 64
# Bodies at least this big are planned (parse, template, tokens) off the event loop;
# below it the thread hop would cost more than the work.
DEFAULT_OFF_LOOP_BYTES = 64 * 1024


@dataclass(frozen=True)
class FrontOptions:
    api_keys: frozenset[str] = frozenset()  # empty: no key asked
    metrics_require_key: bool = False  # /health* and /metrics need a key too
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    off_loop_bytes: int = DEFAULT_OFF_LOOP_BYTES

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise ConfigError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ConfigError("--api-key: a key must be non-empty, without surrounding spaces")

    @classmethod
    def from_config(cls, config: Any) -> FrontOptions:
        return cls(
            api_keys=frozenset(config.api_keys),
            metrics_require_key=config.metrics_require_key,
            max_request_bytes=config.max_request_bytes,
        )
