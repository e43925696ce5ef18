"""The MLX engine with LoRA adapters (``--adapter``, ``--enable-lora``): ``MlxEngine`` plus hooks.

Chosen by ``engines/plugin.py`` when the node serves adapters; without them the
plain engine runs, untouched. Before a prefill's forwards the request's adapter
is selected; before each decode group's forward, its rows' adapters
(``DecodeBatch.before_group``). A request on an adapter reads and fills the
prefix cache under its adapter's name and digest (``PrefixCache.keyed``): an
adapter's K/V for the same tokens differ from the base's, so neither ever
serves the other; the LRU and its byte budget are shared.

Adapters load and unload at run time on the engine thread, between steps
(``load_adapter``/``unload_adapter`` from any thread). An unloaded adapter is
retired: no new request may name it, and its weights go once no running
request uses it, so an unload never changes a running request's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn

from engines.engine_commands import Decode, finish_command
from engines.lora.engine_hooks import EngineAdapters
from engines.mlx_engine import MlxEngine
from engines.model_loader import load_mlx_model, model_info
from engines.prefill import Prefilled
from mlxcel_plugin.engine_api import FINISH_ERROR, EngineConfig, GenerationRequest, ModelInfo
from mlxcel_plugin.errors import ModelNotFoundError

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
        self._held = self.lora.held()  # replaced whole on the engine thread: any thread reads it

    @classmethod
    def from_path(cls, model_path: str, config: EngineConfig) -> LoraMlxEngine:
        model, model_config = load_mlx_model(model_path)
        return cls(model, model_info(model_path, model, model_config), config)

    def load_adapter(self, name: str, path: str) -> str:
        """Load (or replace) ``name`` from ``path``; its digest. Blocks until it is in."""
        return self._run_adapter_command(AdapterCommand(name, path))

    def unload_adapter(self, name: str) -> None:
        self._run_adapter_command(AdapterCommand(name, None))

    def adapter_digests(self) -> dict[str, str]:
        """The adapters a new request may name now: name -> digest of its files."""
        return self._held

    def _run_adapter_command(self, command: AdapterCommand) -> Any:
        self._submit(command)
        return command.done.result(ADAPTER_COMMAND_TIMEOUT_S)

    def _apply(self, command: Any) -> None:
        if not isinstance(command, AdapterCommand):
            if self._names_a_held_adapter(command):
                super()._apply(command)
            return
        digest, error = None, None
        try:
            if command.path is None:
                self.lora.adapters.retire(command.name)
            else:
                digest = self.lora.adapters.load(command.name, command.path).digest
        except Exception as exc:  # noqa: BLE001 - the caller gets it, the engine goes on
            error = exc
        try:
            self._free_retired()
            # What telemetry announces changes before the caller hears it is done: its reply
            # and any telemetry after it then agree (set after, a snapshot between the two
            # announced an unloaded adapter again, and the router sent it requests: a 503).
            self._held = self.lora.held()
        finally:
            if error is not None:
                command.done.set_exception(error)
            else:
                command.done.set_result(digest)

    def _names_a_held_adapter(self, command: Any) -> bool:
        """A new prompt may name a loaded adapter; a handoff's may be retiring (it runs already)."""
        adapter = getattr(getattr(command, "request", None), "adapter", None)
        known = self.lora.adapters.loaded if isinstance(command, Decode) else self._held
        if adapter is None or adapter in known:
            return True
        finish_command(command, FINISH_ERROR,
                       ModelNotFoundError(f"the adapter {adapter!r} is not loaded", param="model"))
        return False

    @contextmanager
    def _prefix_of(self, request: GenerationRequest | None) -> Iterator[None]:
        """While it runs, ``self._prefix`` is the cache of the request's adapter (engine thread)."""
        key = self.lora.prefix_key(request)
        if key is None:
            yield
            return
        base, self._prefix = self._prefix, self._prefix.keyed(key)
        try:
            yield
        finally:
            self._prefix = base

    def _prefill_next(self) -> None:
        # The job's stores (queued by its prefill, copied after its first token) go under its key.
        with self._prefix_of(self._prefills[0].request if self._prefills else None):
            super()._prefill_next()

    def _prefill_request(self, request: GenerationRequest, on_layer: Any = None,
                         on_rows: Any = None) -> Prefilled:
        self.lora.use_request(request)
        return super()._prefill_request(request, on_layer, on_rows)

    def _accept_handoff(self, command: Any) -> None:
        with self._prefix_of(command.request):  # the received K/V are the adapter's
            super()._accept_handoff(command)

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
        for i in indices:  # ``reuse_generated``: each under its own adapter's key
            with self._prefix_of(sequences[i].request):
                super()._store_finished({i})
