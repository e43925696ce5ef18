"""The LoRA engine's prefix cache is keyed by adapter: a repeated adapter prompt reuses the
adapter's own K/V (same tokens as a cache-off run); a base prompt never reuses an adapter's
entry, nor an adapter's a base entry; a split run (prefill, then decode of the handoff)
gives the tokens of one generate."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.utils import load

from engines.lora.engine import LoraMlxEngine
from engines.lora.random_adapter import write_random_adapter
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, PrefixCacheConfig
from tests.engines import support

CHUNK = 16
PROMPT = tuple(range(5, 5 + 3 * CHUNK + 4))  # three whole chunks and a few tokens


@pytest.fixture(scope="module")
def engines(tiny_model_path: Path, tmp_path_factory):
    model, _ = load(str(tiny_model_path))
    root = tmp_path_factory.mktemp("adapters")
    adapters = [f"a{i}={write_random_adapter(model, root / f'a{i}', seed=i)}" for i in range(2)]
    made = []
    for max_bytes in (1 << 28, 0):
        config = EngineConfig(chunk_size_tokens=CHUNK, warmup=False, adapters=tuple(adapters),
                              enable_lora=True, prefix_cache=PrefixCacheConfig(max_bytes=max_bytes))
        engine = LoraMlxEngine.from_path(str(tiny_model_path), config)
        engine.start()
        made.append(engine)
    yield made
    for engine in made:
        engine.close()


def run(engine, name: str, adapter: str | None) -> tuple[list[int], int]:
    events = support.generate(engine, GenerationRequest(name, PROMPT, 8, adapter=adapter))
    return events.tokens, events.events[0].cached_tokens


def test_prefix_entries_are_keyed_by_adapter(engines) -> None:
    cached, plain = engines
    reference = {a: run(plain, f"ref-{a}", a)[0] for a in (None, "a0", "a1")}
    assert len({tuple(tokens) for tokens in reference.values()}) == 3
    first, cached_first = run(cached, "a0-1", "a0")
    assert (first, cached_first) == (reference["a0"], 0)
    again, cached_again = run(cached, "a0-2", "a0")
    assert again == reference["a0"] and cached_again > 0  # the adapter's own entry
    assert run(cached, "a1-1", "a1") == (reference["a1"], 0)  # not a0's entry
    assert run(cached, "base-1", None) == (reference[None], 0)  # not an adapter's entry
    assert run(cached, "base-2", None)[1] > 0
    assert cached.stats().prefix_cache.hit_tokens >= cached_again
    assert cached.adapter_digests().keys() == {"a0", "a1"}


def test_a_split_run_on_an_adapter_equals_one_generate(engines) -> None:
    cached, plain = engines
    request = GenerationRequest("split-a1", PROMPT, 8, adapter="a1")
    assert support.split(cached, request) == run(plain, "gen-a1", "a1")[0]


def test_an_unloaded_adapter_is_refused_without_stopping_the_engine(engines) -> None:
    cached, _ = engines
    events = support.generate(cached, GenerationRequest("nope", PROMPT, 4, adapter="nope"))
    assert events.events[-1].finish_reason == "error" and "nope" in events.events[-1].error
    assert run(cached, "after", None)[0]


def test_announced_adapters_change_before_a_load_or_unload_returns(engines, tiny_model_path,
                                                                  tmp_path, monkeypatch) -> None:
    """What ``adapter_digests`` (telemetry) says when the caller is told a command is done:
    already the new set, so a snapshot taken after the reply never shows an unloaded adapter."""
    cached, _ = engines
    seen: list[set[str]] = []
    submit = cached._submit

    def watched(command) -> None:
        if hasattr(command, "done"):
            command.done.add_done_callback(lambda _: seen.append(set(cached.adapter_digests())))
        submit(command)

    monkeypatch.setattr(cached, "_submit", watched)
    model, _ = load(str(tiny_model_path))
    cached.load_adapter("a9", str(write_random_adapter(model, tmp_path / "a9", seed=9)))
    cached.unload_adapter("a9")
    assert seen == [{"a0", "a1", "a9"}, {"a0", "a1"}]
