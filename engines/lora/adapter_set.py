"""The adapters one model serves, by name: loaded into slots of its ``MultiLoRALinear`` layers.

``AdapterSet.attach(model)`` wraps nothing at first; each ``load`` wraps the linear
layers its adapter touches (once) and puts its weights in a free slot; ``unload``
frees the slot. ``use(names)`` says, before a forward, which adapter each batch
row runs with (None: the base).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn
from mlx.utils import tree_unflatten

from engines.lora.files import AdapterFiles, read_adapter
from engines.lora.multi_lora import BASE_SLOT, AdapterRows, MultiLoRALinear, linear_dims
from mlxcel_plugin.errors import ConfigError, ModelNotFoundError


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    slot: int
    digest: str
    path: Path


class AdapterSet:
    def __init__(self, model: nn.Module):
        self.model = model
        self.rows = AdapterRows()
        self.loaded: dict[str, LoadedAdapter] = {}
        self.retiring: set[str] = set()  # unloaded by name, still decoding for running requests
        self._layers: dict[str, MultiLoRALinear] = {}
        self._touched: dict[str, tuple[str, ...]] = {}  # adapter name -> its module paths

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        """Load (or replace) the adapter ``name``; ConfigError when it does not fit the model.

        The same files again under the same name change nothing (nor running requests).
        """
        files = read_adapter(path)
        modules = dict(self.model.named_modules())
        missing = sorted(p for p in files.layers if p not in modules and p not in self._layers)
        if missing:
            raise ConfigError(f"adapter {path}: the model has no layer {missing[0]}")
        held = self.loaded.get(name)
        self.retiring.discard(name)
        if held is not None and held.digest == files.digest:
            return held  # the same files again (a router catching a node up): nothing to redo
        if held is not None:
            self.unload(name)
        slot = self._free_slot()
        try:
            self._put(files, slot, modules)
        except ValueError as exc:
            self._drop(name, slot, tuple(files.layers))
            raise ConfigError(f"adapter {path}: {exc}") from exc
        self._touched[name] = tuple(files.layers)
        self.loaded[name] = LoadedAdapter(name, slot, files.digest, files.path)
        return self.loaded[name]

    def unload(self, name: str) -> None:
        adapter = self.loaded.pop(name, None)
        if adapter is None:
            raise ModelNotFoundError(f"the adapter {name!r} is not loaded", param="lora_name")
        self._drop(name, adapter.slot, self._touched.pop(name))

    def retire(self, name: str) -> None:
        """No new request may name it; running ones keep it until ``unload``."""
        if name not in self.loaded:
            raise ModelNotFoundError(f"the adapter {name!r} is not loaded", param="lora_name")
        self.retiring.add(name)

    def use(self, names: list[str | None]) -> None:
        """The adapter of each row of the next forward (None: the base)."""
        self.rows.set([self.slot_of(name) for name in names])

    def slot_of(self, name: str | None) -> int:
        if name is None:
            return BASE_SLOT
        adapter = self.loaded.get(name)
        if adapter is None:
            raise ModelNotFoundError(f"the adapter {name!r} is not loaded", param="model")
        return adapter.slot

    def _free_slot(self) -> int:
        used = {a.slot for a in self.loaded.values()}
        return next(slot for slot in range(1, len(used) + 2) if slot not in used)

    def _put(self, files: AdapterFiles, slot: int, modules: dict[str, nn.Module]) -> None:
        for path, weights in files.layers.items():
            layer = self._layers.get(path) or self._wrap(path, modules[path])
            layer.put(slot, weights, files.scale)

    def _drop(self, name: str, slot: int, paths: tuple[str, ...]) -> None:
        for path in paths:
            if path in self._layers:
                self._layers[path].drop(slot)

    def _wrap(self, path: str, linear: nn.Module) -> MultiLoRALinear:
        in_dims, out_dims = linear_dims(linear)
        layer = MultiLoRALinear(linear, self.rows, in_dims, out_dims)
        self.model.update_modules(tree_unflatten([(path, layer)]))
        self._layers[path] = layer
        return layer
