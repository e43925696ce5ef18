"""The MLX engine with LoRA adapters (``--adapter``): ``MlxEngine`` plus three hooks.

Chosen by ``engines/plugin.py`` when the node serves adapters; without them the
plain engine runs, untouched. Before a prefill's forwards the request's adapter
is selected; before each decode group's forward, its rows' adapters
(``DecodeBatch.before_group``). A request on an adapter neither reads nor fills
the prefix cache (keyed by tokens: an adapter's K/V for the same tokens differ),
and a finished one is not kept by ``reuse_generated``.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from engines.lora.engine_hooks import EngineAdapters
from engines.mlx_engine import MlxEngine
from engines.model_loader import load_mlx_model, model_info
from engines.prefill import Prefilled, prefill_request
from engines.prefix.cache import PrefixCache
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, ModelInfo


class LoraMlxEngine(MlxEngine):
    def __init__(self, model: nn.Module, info: ModelInfo, config: EngineConfig):
        super().__init__(model, info, config)
        self.lora = EngineAdapters.from_config(model, config)
        self._batch.before_group = self.lora.use_sequences
        self._no_prefix = PrefixCache(0, self.config.chunk_size_tokens)

    @classmethod
    def from_path(cls, model_path: str, config: EngineConfig) -> LoraMlxEngine:
        model, model_config = load_mlx_model(model_path)
        return cls(model, model_info(model_path, model, model_config), config)

    def _prefill_request(self, request: GenerationRequest, on_layer: Any = None,
                         on_rows: Any = None) -> Prefilled:
        self.lora.use_request(request)
        if request.adapter is None:
            return super()._prefill_request(request, on_layer, on_rows)
        return prefill_request(self.model, request, self._no_prefix, self.config, self.info,
                               on_layer, on_rows)  # fmt: skip

    def _store_finished(self, indices: set[int]) -> None:
        sequences = self._batch.sequences
        super()._store_finished({i for i in indices if sequences[i].request.adapter is None})
