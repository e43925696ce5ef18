"""What a decode node holds per request: a router's claim, complete KV, a live sequence.

Also the node's parts (engine, scheduler config, codecs, limits) and the one
error its handoff bookkeeping names (``unknown_request``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from mlxcel_plugin.engine_api import Engine
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import KVCodec
from mlxcel_plugin.nodes.handoff_receiver import Completed
from mlxcel_plugin.nodes.outbox import Outbox
from mlxcel_plugin.scheduling import DecodeSchedulerConfig


class UnknownRequest(HandoffError):
    code = "unknown_request"


@dataclass
class Claim:
    owner: Outbox
    created_s: float = field(default_factory=time.monotonic)
    adapter: str | None = None  # the LoRA adapter the router named (None: the base)


@dataclass
class Ready:
    """Complete KV; acked only once claimed, so the prefill keeps its copy until we own it."""

    completed: Completed
    at_s: float = field(default_factory=time.monotonic)
    acked: bool = False


@dataclass
class Live:
    owner: Outbox
    last_token_s: float = field(default_factory=time.monotonic)


@dataclass
class DecodeNodeParts:
    engine: Engine
    scheduler_config: DecodeSchedulerConfig
    codecs: Mapping[str, KVCodec]
    transfer_timeout_s: float = 30.0
    kv_budget_bytes: int = 4 << 30  # sizes the receive pool (kv_serde.pool.pool_bytes_for)
    model_bytes: int = 0
