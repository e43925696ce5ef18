"""What a prefill node is built from, and what it tracks per request."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from mlxcel_plugin.compatibility import KVProfile
from mlxcel_plugin.engine_api import Engine, GenerationRequest, PrefillResult
from mlxcel_plugin.kv_codecs import KVCodec
from mlxcel_plugin.nodes.handoff_sender import OutgoingHandoff
from mlxcel_plugin.nodes.outbox import Outbox
from mlxcel_plugin.scheduling import PrefillSchedulerConfig
from mlxcel_plugin.transfer import StrategyFactory, TransferChoice, TransferConfig


@dataclass
class NodeJob:
    """One request on this node, from REQUEST to the ack of its handoff (or its failure)."""

    request: GenerationRequest
    owner: Outbox  # the router link that sent the request
    target: str
    pinned: bool  # the router chose the target: never hand off elsewhere
    submitted_s: float
    prefix_tokens: int = 0  # the decode node holds these already: a delta handoff
    handoff_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    handoff: OutgoingHandoff | None = None
    choice: TransferChoice | None = None  # the selector's, for its measured codec ratio
    result: PrefillResult | None = None
    first_token_s: float = 0.0
    waiter: asyncio.Task[None] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class PrefillNodeParts:
    """What a prefill node is built from (the role wires them from config)."""

    engine: Engine
    scheduler_config: PrefillSchedulerConfig
    transfer_config: TransferConfig
    strategies: Mapping[str, StrategyFactory]
    codecs: Mapping[str, KVCodec]
    decode_peers: tuple[str, ...] = ()
    kv_budget_bytes: int = 4 * 1024**3
    kv_profile: KVProfile | None = None  # what it announces (None: from the engine's fingerprint)
