"""What the MLX engine calls to serve adapters: loaded at start, chosen per forward.

The engine asks ``use_request`` before a prefill's forwards and ``use_sequences``
before each decode group's forward (``DecodeBatch.before_group``). A request on
an adapter never touches the prefix cache: the cache's entries are keyed by
tokens, and an adapter's K/V for the same tokens differ from the base's.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import mlx.nn as nn

from engines.lora.adapter_set import AdapterSet
from mlxcel_plugin.adapter_specs import parse_adapter_spec
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest


class EngineAdapters:
    def __init__(self, model: nn.Module):
        self.adapters = AdapterSet(model)

    @classmethod
    def from_config(cls, model: nn.Module, config: EngineConfig) -> EngineAdapters:
        hooks = cls(model)
        for spec in map(parse_adapter_spec, config.adapters):
            hooks.adapters.load(spec.name, spec.path)
        return hooks

    @property
    def names(self) -> list[str]:
        return list(self.adapters.loaded)

    def use_request(self, request: GenerationRequest) -> None:
        self.adapters.use([request.adapter])

    def use_sequences(self, sequences: Seq[Any]) -> None:
        self.adapters.use([s.request.adapter for s in sequences])

    def prefix_for(self, request: GenerationRequest, prefix: Any, no_prefix: Any) -> Any:
        """The prefix cache this request may read and fill: none on an adapter."""
        return prefix if request.adapter is None else no_prefix
