"""The bounded, in-memory store of responses (``store: true``) for ``previous_response_id``.

Each entry keeps the response body (``GET /v1/responses/{id}``) and the
conversation it ended as chat messages (its input, earlier turns and its own
output), so a continuation needs no client resend. Bounded by count and by
bytes (the entries' JSON size); the least recently used entry goes first. It
lives in this process only: a restart loses every entry, and each router
process of a cluster has its own (a continuation must reach the router that
stored the response). Bounds: ``MLXCEL_RESPONSES_STORE_MAX_COUNT`` (default
1000) and ``MLXCEL_RESPONSES_STORE_MAX_BYTES`` (default 64 MiB).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.errors import ConfigError

DEFAULT_MAX_COUNT = 1000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
COUNT_ENV = "MLXCEL_RESPONSES_STORE_MAX_COUNT"
BYTES_ENV = "MLXCEL_RESPONSES_STORE_MAX_BYTES"


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    messages: list[dict[str, Any]]  # the whole conversation, this response's output last
    size_bytes: int


class ResponseStore:
    """Least recently used first out, within ``max_count`` entries and ``max_bytes``."""

    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_count < 0 or max_bytes < 0:
            raise ConfigError("the response store's bounds must be >= 0")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.size_bytes = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ResponseStore:
        return cls(_env_int(env, COUNT_ENV, DEFAULT_MAX_COUNT),
                   _env_int(env, BYTES_ENV, DEFAULT_MAX_BYTES))  # fmt: skip

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep ``body`` under its id; False when one entry alone is over the byte bound."""
        size = len(json.dumps(body)) + len(json.dumps(messages))
        if size > self.max_bytes or self.max_count == 0:
            return False
        self.delete(body["id"])
        self._entries[body["id"]] = StoredResponse(body, messages, size)
        self.size_bytes += size
        while len(self._entries) > self.max_count or self.size_bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.size_bytes -= oldest.size_bytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            # Big bodies are planned in a worker thread: the entry may be gone by now.
            with contextlib.suppress(KeyError):
                self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.size_bytes -= entry.size_bytes
        return True


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
