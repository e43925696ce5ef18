"""ModelSet over real MLX engines (two tiny checkpoints, llama and qwen3, in this process).

* A model loads in a worker thread while another model's engine thread decodes: the
  decoding model's tokens are those it gives alone (MLX evaluates on per-thread streams).
* A memory budget that fits one model's weights: loading the second evicts the idle first,
  whose engine is closed, and the log says why; while the first streams, a request for
  the second is refused after its wait and the streaming model stays loaded.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from engines.plugin import make_mlx_engine
from engines.tiny_models import ensure_arch_model
from mlxcel_plugin.engine_api import Engine, EngineConfig, GenerationRequest, SamplingParams
from mlxcel_plugin.errors import AtCapacityError
from mlxcel_plugin.model_specs import checkpoint_bytes
from mlxcel_plugin.scheduling.model_residency import ResidencyLimits
from mlxcel_plugin.scheduling.model_set import ModelSet
from tests.conftest import model_cache_root
from tests.engines import support

CONFIG = EngineConfig(warmup=False)
DEADLINE_S = 300
TOKENS = 300  # long enough that the other model's load overlaps the decode


def load(name: str, path: str) -> Engine:
    engine = make_mlx_engine(path, CONFIG)
    engine.start()
    return engine


def request(request_id: str, tokens: int = TOKENS) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(range(100, 164)), tokens, SamplingParams())


@pytest.fixture(scope="module")
def paths(tiny_model_path: Path) -> dict[str, str]:
    return {"llama": str(tiny_model_path),
            "qwen3": str(ensure_arch_model("qwen3", root=model_cache_root()))}  # fmt: skip


def make_set(paths: dict[str, str], memory_bytes: int = 0, wait_s: float = 60) -> ModelSet:
    sizes = {name: checkpoint_bytes(path) for name, path in paths.items()}
    return ModelSet(paths, sizes, ResidencyLimits(memory_bytes=memory_bytes), load,
                    wait_s=wait_s)  # fmt: skip


def one_model_budget(paths: dict[str, str]) -> int:
    return max(checkpoint_bytes(path) for path in paths.values()) * 3 // 2


def test_a_load_beside_a_decoding_model_leaves_its_tokens_alone(paths) -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        models = make_set(paths)
        try:
            async with models.lease("llama") as llama:
                alone = await asyncio.to_thread(support.generate, llama, request("alone"))
                decoding = asyncio.create_task(
                    asyncio.to_thread(support.generate, llama, request("beside"))
                )
                async with models.lease("qwen3"):  # loads while llama decodes
                    assert not decoding.done(), "the decode ended before the load: too short"
                beside = await decoding
            return alone.tokens, beside.tokens
        finally:
            await models.close()

    alone, beside = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert len(alone) == TOKENS and beside == alone


def test_a_memory_budget_for_one_model_evicts_the_idle_one(paths, caplog) -> None:
    async def scenario() -> tuple[ModelSet, Engine, list[int]]:
        models = make_set(paths, memory_bytes=one_model_budget(paths))
        try:
            async with models.lease("llama") as llama:
                await asyncio.to_thread(support.generate, llama, request("llama", 8))
            async with models.lease("qwen3") as qwen3:
                tokens = (await asyncio.to_thread(support.generate, qwen3, request("q", 8))).tokens
                assert models.status() == {"llama": False, "qwen3": True}
            return models, llama, tokens
        finally:
            await models.close()

    with caplog.at_level(logging.INFO, logger="mlxcel_plugin.scheduling.model_set"):
        models, llama, tokens = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert len(tokens) == 8
    assert models.counts["llama"].evictions == 1 and models.counts["qwen3"].loads == 1
    assert llama._closed  # the evicted engine was closed (its thread stopped)
    assert any("evicting model llama (idle, least recently used) to load qwen3: "
               in message and "--model-memory-bytes" in message
               for message in caplog.messages)  # fmt: skip


def test_a_memory_budget_never_evicts_a_streaming_model(paths) -> None:
    async def scenario() -> tuple[ModelSet, Engine, list[int]]:
        models = make_set(paths, memory_bytes=one_model_budget(paths), wait_s=0.2)
        try:
            async with models.lease("llama") as llama:  # held while its request streams
                decoding = asyncio.create_task(
                    asyncio.to_thread(support.generate, llama, request("streaming"))
                )
                with pytest.raises(AtCapacityError):
                    async with models.lease("qwen3"):
                        pass
                assert models.status() == {"llama": True, "qwen3": False}
                tokens = (await decoding).tokens
            async with models.lease("qwen3"):  # llama idle now: evicted for qwen3
                assert models.status() == {"llama": False, "qwen3": True}
            return models, llama, tokens
        finally:
            await models.close()

    models, llama, tokens = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert len(tokens) == TOKENS
    assert models.counts["qwen3"].refusals == 1 and models.counts["llama"].evictions == 1
