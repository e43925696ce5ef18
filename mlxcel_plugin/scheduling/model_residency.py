"""Which of a node's models are in memory, and which idle one to evict for the next (pure).

A model is *loaded*, *loading* or out. Both loaded and loading models count
against the bounds: at most ``max_loaded`` models (0: no count bound) and
``memory_bytes`` of weights together. A model with requests running or
queued (``active``) is never evicted; among idle loaded models the least
recently used goes first. ``ModelSet`` (``model_set.py``) drives this from the
event loop, so each call sees a consistent state without locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxcel_plugin.errors import ConfigError

MIB = 1 << 20


@dataclass(frozen=True)
class ResidencyLimits:
    max_loaded: int = 0  # 0: as many as memory allows
    memory_bytes: int = 0  # weights of every loaded model together


@dataclass
class _Model:
    size_bytes: int
    loaded: bool = False
    loading: bool = False
    active: int = 0  # requests running or waiting for it
    last_used: int = 0  # a tick of the residency's own clock: LRU order without wall time


@dataclass(frozen=True)
class LoadPlan:
    """What loading a model takes: these idle models evicted first (LRU first), and why."""

    evict: tuple[str, ...]
    reason: str = ""


@dataclass
class ModelResidency:
    sizes: dict[str, int]  # model name -> its weights' bytes (checkpoint_bytes)
    limits: ResidencyLimits
    _models: dict[str, _Model] = field(init=False)
    _tick: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        for name, size in self.sizes.items():
            if self.limits.memory_bytes and size > self.limits.memory_bytes:
                raise ConfigError(f"model {name} ({size / MIB:.0f} MiB of weights) does not fit "
                                  f"the model memory budget ({self.limits.memory_bytes / MIB:.0f}"
                                  " MiB, --model-memory-bytes)")  # fmt: skip
        self._models = {name: _Model(size) for name, size in self.sizes.items()}

    # -- state -------------------------------------------------------------------------

    def is_loaded(self, name: str) -> bool:
        return self._models[name].loaded

    def is_loading(self, name: str) -> bool:
        return self._models[name].loading

    def loaded_names(self) -> list[str]:
        return [name for name, model in self._models.items() if model.loaded]

    def active(self, name: str) -> int:
        return self._models[name].active

    def begin(self, name: str) -> None:
        """A request for ``name`` arrived (waiting or running): its model stays put."""
        self._models[name].active += 1
        self.touch(name)

    def end(self, name: str) -> None:
        model = self._models[name]
        model.active = max(0, model.active - 1)
        self.touch(name)

    def touch(self, name: str) -> None:
        self._tick += 1
        self._models[name].last_used = self._tick

    def loading_started(self, name: str) -> None:
        self._models[name].loading = True

    def loading_ended(self, name: str, loaded: bool) -> None:
        model = self._models[name]
        model.loading, model.loaded = False, loaded

    def unloaded(self, name: str) -> None:
        self._models[name].loaded = False

    # -- decisions ---------------------------------------------------------------------

    def plan(self, name: str) -> LoadPlan | None:
        """What loading ``name`` needs evicted now; None when busy models are in the way."""
        held = [n for n, m in self._models.items() if (m.loaded or m.loading) and n != name]
        idle = sorted((n for n in held if self._evictable(n)),
                      key=lambda n: self._models[n].last_used)  # fmt: skip
        evict: list[str] = []
        while not self._fits(name, [n for n in held if n not in evict]):
            if not idle:
                return None
            evict.append(idle.pop(0))
        return LoadPlan(tuple(evict), self._reason(name, held) if evict else "")

    def _evictable(self, name: str) -> bool:
        model = self._models[name]
        return model.loaded and not model.loading and model.active == 0

    def _fits(self, name: str, others: list[str]) -> bool:
        limits = self.limits
        if limits.max_loaded and len(others) + 1 > limits.max_loaded:
            return False
        total = self._models[name].size_bytes + sum(self._models[n].size_bytes for n in others)
        return not limits.memory_bytes or total <= limits.memory_bytes

    def _reason(self, name: str, held: list[str]) -> str:
        limits = self.limits
        if limits.max_loaded and len(held) + 1 > limits.max_loaded:
            return f"{len(held)} loaded = --max-loaded-models {limits.max_loaded}"
        total = sum(self._models[n].size_bytes for n in [name, *held])
        return (f"{total / MIB:.0f} MiB of weights > --model-memory-bytes "
                f"{limits.memory_bytes / MIB:.0f} MiB")  # fmt: skip
