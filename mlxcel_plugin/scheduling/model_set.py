"""A hybrid node's several models: loaded on first use (or at start), evicted LRU when idle.

``ModelSet.lease(name)`` gives a request its model's engine, loading it first
when needed. A load that would break a bound (``ModelResidency``) first evicts
the least recently used idle models; when only busy models are in the way the
request waits, at most ``wait_s``, for one to go idle, then gets a 503
(``AtCapacityError``, with a retry hint). Loads run in a worker thread, each
model with its own engine thread, so the other models keep streaming (MLX
evaluates on per-thread streams; docs/models-and-adapters.md). A load runs as a task of its
own: a client that gives up waiting does not lose the model it started.

No MLX here: ``load`` is the engine plugin's factory plus ``start``, given by the role.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from mlxcel_plugin.engine_api import Engine
from mlxcel_plugin.errors import AtCapacityError, EngineError
from mlxcel_plugin.scheduling.model_residency import MIB, LoadPlan, ModelResidency, ResidencyLimits

log = logging.getLogger(__name__)

# (name, checkpoint path) -> a started engine; blocking, run in a worker thread.
LoadEngine = Callable[[str, str], Engine]
RETRY_AFTER_S = 5.0  # a busy model's requests usually end within seconds


@dataclass
class ModelCounts:
    """What one model's loads and evictions came to (``model_set_metrics``)."""

    loads: int = 0
    load_failures: int = 0
    last_load_s: float = 0.0
    evictions: int = 0
    waits: int = 0  # requests that waited for a busy model to go idle
    refusals: int = 0  # requests answered 503 after waiting ``wait_s``


class ModelSet:
    def __init__(self, paths: Mapping[str, str], sizes: Mapping[str, int],
                 limits: ResidencyLimits, load: LoadEngine, *, wait_s: float,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.paths = dict(paths)
        self.sizes = dict(sizes)
        self.limits = limits
        self.residency = ModelResidency(self.sizes, limits)
        self.counts = {name: ModelCounts() for name in self.paths}
        self.wait_s = wait_s
        self._load, self._clock = load, clock
        self._engines: dict[str, Engine] = {}
        self._loads: dict[str, asyncio.Task[None]] = {}
        self._changed: asyncio.Event | None = None

    def status(self) -> dict[str, bool]:
        """Each configured model: whether it is loaded now."""
        return {name: self.residency.is_loaded(name) for name in self.paths}

    def engine(self, name: str) -> Engine | None:
        return self._engines.get(name)

    @asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[Engine]:
        """``name``'s engine, loaded when needed; held (never evicted) until the block ends."""
        self.residency.begin(name)
        try:
            yield await self._ready(name)
        finally:
            self.residency.end(name)
            self._signal()

    async def start(self, load_all: bool) -> None:
        """``--load-on-start``: load models in order while they fit without evicting."""
        for name in self.paths if load_all else ():
            plan = self.residency.plan(name)
            if plan is None or plan.evict:
                log.info("load on start: %s and later models load on first use (bounds)", name)
                return
            await self._loading(name, plan)

    async def close(self) -> None:
        for task in list(self._loads.values()):
            await asyncio.gather(task, return_exceptions=True)
        engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            await asyncio.to_thread(engine.close)

    # -- getting a model ready ----------------------------------------------------------

    async def _ready(self, name: str) -> Engine:
        deadline = self._clock() + self.wait_s
        waited = False
        while True:
            if self.residency.is_loaded(name):
                return self._engines[name]
            if name in self._loads:
                await asyncio.shield(self._loads[name])  # a failed load raises here
                continue
            plan = self.residency.plan(name)
            if plan is not None:
                await self._loading(name, plan)
                continue
            if not waited:
                self.counts[name].waits += 1
                log.info("model %s waits: the loaded models (%s) are busy", name,
                         ", ".join(self.residency.loaded_names()))  # fmt: skip
            waited = True
            await self._wait_for_change(name, deadline)

    async def _loading(self, name: str, plan: LoadPlan) -> None:
        """Start ``name``'s load as its own task (evictions first) and wait for it."""
        self.residency.loading_started(name)
        for victim in plan.evict:  # out of the books now: no other plan counts them
            self.residency.unloaded(victim)
        task = asyncio.get_running_loop().create_task(self._load_task(name, plan))
        task.add_done_callback(_retrieved)
        self._loads[name] = task
        await asyncio.shield(task)

    async def _load_task(self, name: str, plan: LoadPlan) -> None:
        loaded = False
        try:
            for victim in plan.evict:
                await self._evict(victim, name, plan.reason)
            self._engines[name] = await self._load_engine(name)
            loaded = True
        finally:
            self.residency.loading_ended(name, loaded)
            self._loads.pop(name, None)
            self._signal()

    async def _evict(self, victim: str, for_model: str, reason: str) -> None:
        log.info("evicting model %s (idle, least recently used) to load %s: %s", victim,
                 for_model, reason)  # fmt: skip
        await asyncio.to_thread(self._engines.pop(victim).close)
        await asyncio.to_thread(gc.collect)  # the weights go now, not at a later collection
        self.counts[victim].evictions += 1

    async def _load_engine(self, name: str) -> Engine:
        counts, started = self.counts[name], self._clock()
        log.info("loading model %s from %s (%.1f MiB of weights)", name, self.paths[name],
                 self.sizes[name] / MIB)  # fmt: skip
        try:
            engine = await asyncio.to_thread(self._load, name, self.paths[name])
        except Exception as exc:
            counts.load_failures += 1
            log.error("loading model %s failed: %s", name, exc)
            raise EngineError(f"model {name} could not be loaded: {exc}") from exc
        counts.loads += 1
        counts.last_load_s = self._clock() - started
        log.info("loaded model %s in %.2f s", name, counts.last_load_s)
        return engine

    # -- waiting for a busy model to go idle --------------------------------------------

    async def _wait_for_change(self, name: str, deadline: float) -> None:
        remaining = deadline - self._clock()
        if remaining <= 0:
            self.counts[name].refusals += 1
            busy = ", ".join(self.residency.loaded_names()) or "none"
            raise AtCapacityError(
                f"model {name} is not loaded and the loaded models ({busy}) are all serving "
                f"requests (waited {self.wait_s:g} s); retry later", retry_after_s=RETRY_AFTER_S)
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), remaining)
        except TimeoutError:
            pass

    def _signal(self) -> None:
        """A request ended or a load finished: waiters look again."""
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()


def _retrieved(task: asyncio.Task[None]) -> None:
    """A load's failure is raised to the requests waiting on it; none left is fine too."""
    if not task.cancelled():
        task.exception()
