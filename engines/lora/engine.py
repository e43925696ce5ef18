"""The MLX engine with LoRA adapters (``--adapter``, ``--enable-lora``): ``MlxEngine`` plus hooks.

Chosen by ``engines/plugin.py`` when the node serves adapters; without them the
plain engine runs, untouched. Before a prefill's forwards the request's adapter
is selected; before each decode group's forward, its rows' adapters
(``DecodeBatch.before_group``). A request on an adapter neither reads nor fills
the prefix cache (keyed by tokens: an adapter's K/V for the same tokens differ),
and a finished one is not kept by ``reuse_generated``.

Adapters load and unload at run time on the engine thread, between steps
(``load_adapter``/``unload_adapter`` from any thread). An unloaded adapter is
retired: no new request may name it, and its weights go once no running
request uses it, so an unload never changes a running request's tokens.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn

from engines.lora.engine_hooks import EngineAdapters
from engines.mlx_engine import MlxEngine
from engines.model_loader import load_mlx_model, model_info
from engines.prefill import Prefilled, prefill_request
from engines.prefix.cache import PrefixCache
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, ModelInfo

ADAPTER_COMMAND_TIMEOUT_S = 120.0


@dataclass
class AdapterCommand:
    name: str
    path: str | None  # None: unload
    done: Future = field(default_factory=Future)


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

    def load_adapter(self, name: str, path: str) -> str:
        """Load (or replace) ``name`` from ``path``; its digest. Blocks until it is in."""
        return self._run_adapter_command(AdapterCommand(name, path))

    def unload_adapter(self, name: str) -> None:
        self._run_adapter_command(AdapterCommand(name, None))

    def _run_adapter_command(self, command: AdapterCommand) -> Any:
        self._submit(command)
        return command.done.result(ADAPTER_COMMAND_TIMEOUT_S)

    def _apply(self, command: Any) -> None:
        if not isinstance(command, AdapterCommand):
            super()._apply(command)
            return
        try:
            if command.path is None:
                self.lora.adapters.retire(command.name)
                command.done.set_result(None)
            else:
                command.done.set_result(self.lora.adapters.load(command.name, command.path).digest)
        except Exception as exc:  # noqa: BLE001 - the caller gets it, the engine goes on
            command.done.set_exception(exc)
        self._free_retired()

    def _prefill_request(self, request: GenerationRequest, on_layer: Any = None,
                         on_rows: Any = None) -> Prefilled:
        self.lora.use_request(request)
        if request.adapter is None:
            return super()._prefill_request(request, on_layer, on_rows)
        return prefill_request(self.model, request, self._no_prefix, self.config, self.info,
                               on_layer, on_rows)  # fmt: skip

    def _decode_step(self) -> None:
        super()._decode_step()
        if self.lora.adapters.retiring:
            self._free_retired()

    def _free_retired(self) -> None:
        running = {s.request.adapter for s in self._batch.sequences}
        running |= {s.request.adapter for s, _ in self._waiting}
        running |= {job.request.adapter for job in self._prefills}
        for name in self.lora.adapters.retiring - running:
            self.lora.adapters.unload(name)
            self.lora.adapters.retiring.discard(name)

    def _store_finished(self, indices: set[int]) -> None:
        sequences = self._batch.sequences
        super()._store_finished({i for i in indices if sequences[i].request.adapter is None})
