"""What the MLX engine calls to serve adapters: loaded at start, chosen per forward.

The engine asks ``use_request`` before a prefill's forwards and ``use_sequences``
before each decode group's forward (``DecodeBatch.before_group``). A request on
an adapter keys its prefix-cache entries by ``prefix_key``: the adapter's name
and digest, as an adapter's K/V for the same tokens differ from the base's (and
from another version's of the same name).
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

    def held(self) -> dict[str, str]:
        """Adapters a new request may name: name -> digest (retiring ones are not)."""
        return {name: adapter.digest for name, adapter in self.adapters.loaded.items()
                if name not in self.adapters.retiring}

    def prefix_key(self, request: GenerationRequest | None) -> tuple[str, str] | None:
        """The prefix-cache key of the request's K/V: None for the base's."""
        if request is None or request.adapter is None:
            return None
        adapter = self.adapters.loaded.get(request.adapter)
        return None if adapter is None else (adapter.name, adapter.digest)
