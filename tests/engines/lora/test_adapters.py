"""LoRA adapters on the tiny checkpoint: a seeded adapter changes the output, gives the
tokens mlx-lm gives with the same adapter (as LoRA layers and fused into the weights),
and a batch mixing the base and 3 adapters gives each row the tokens it gets alone."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import load

from engines.lora.adapter_set import AdapterSet
from engines.lora.files import read_adapter
from engines.lora.random_adapter import write_random_adapter
from mlxcel_plugin.errors import ConfigError, ModelNotFoundError

STEPS = 12
PROMPTS = [[1, 504, 3000, 28, 7, 95], [1, 42, 17, 900, 12, 6], [1, 8, 8, 331, 27, 70],
           [1, 2000, 5, 63, 410, 9]]  # fmt: skip


def greedy(model, prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)
    tokens = [mx.argmax(logits[:, -1], axis=-1)]
    for _ in range(steps - 1):
        logits = model(tokens[-1][:, None], cache=cache)
        tokens.append(mx.argmax(logits[:, -1], axis=-1))
    return mx.stack(tokens, axis=1).tolist()


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory) -> list[Path]:
    model, _ = load(str(tiny_model_path))
    root = tmp_path_factory.mktemp("adapters")
    return [write_random_adapter(model, root / f"a{seed}", seed=seed, rank=2 + seed)
            for seed in range(3)]  # fmt: skip


def test_an_adapter_changes_the_output_as_mlx_lm_applies_it(tiny_model_path, adapters) -> None:
    model, _ = load(str(tiny_model_path))
    base = greedy(model, PROMPTS[:1])
    served = AdapterSet(model)
    served.load("a0", adapters[0])
    served.use(["a0"])
    ours = greedy(model, PROMPTS[:1])
    assert ours != base
    reference = load_adapters(load(str(tiny_model_path))[0], str(adapters[0]))
    assert greedy(reference, PROMPTS[:1]) == ours
    fused = [(name, module.fuse()) for name, module in reference.named_modules()
             if hasattr(module, "fuse")]  # fmt: skip
    reference.update_modules(tree_unflatten(fused))
    assert greedy(reference, PROMPTS[:1]) == ours


def test_a_mixed_batch_gives_each_row_its_solo_tokens(tiny_model_path, adapters) -> None:
    model, _ = load(str(tiny_model_path))
    served = AdapterSet(model)
    for index, path in enumerate(adapters):
        served.load(f"a{index}", path)
    names = [None, "a0", "a1", "a2"]
    solo = []
    for prompt, name in zip(PROMPTS, names, strict=True):
        served.use([name])
        solo.append(greedy(model, [prompt])[0])
    assert len({tuple(tokens) for tokens in solo}) == len(names)
    served.use(names)
    assert greedy(model, PROMPTS) == solo
    served.use(list(reversed(names)))  # the rows' order does not matter
    assert greedy(model, list(reversed(PROMPTS))) == list(reversed(solo))


def test_unload_frees_the_slot_and_a_later_request_is_refused(tiny_model_path,
                                                              adapters) -> None:
    model, _ = load(str(tiny_model_path))
    base = greedy(model, PROMPTS[:1])
    served = AdapterSet(model)
    served.load("a0", adapters[0])
    served.unload("a0")
    with pytest.raises(ModelNotFoundError):
        served.use(["a0"])
    served.use([None])
    assert greedy(model, PROMPTS[:1]) == base
    assert served.load("a1", adapters[1]).slot == 1  # the freed slot again


def test_bad_adapters_are_refused_by_name(tmp_path: Path, adapters) -> None:
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters[0] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    with pytest.raises(ConfigError, match="dora"):
        read_adapter(dora)
    with pytest.raises(ConfigError, match="not a directory"):
        read_adapter(tmp_path / "nowhere")
    assert read_adapter(adapters[0]).digest == read_adapter(adapters[0]).digest
    assert read_adapter(adapters[0]).digest != read_adapter(adapters[1]).digest


def test_loading_the_same_files_again_keeps_the_slot_and_revives_a_retiring_one(
        tiny_model_path, adapters) -> None:  # fmt: skip
    model, _ = load(str(tiny_model_path))
    served = AdapterSet(model)
    first = served.load("a0", adapters[0])
    served.retire("a0")  # unloaded by name while a request still runs on it
    assert served.load("a0", adapters[0]) is first and "a0" not in served.retiring
    replaced = served.load("a0", adapters[1])  # other files: replaced
    assert replaced.digest != first.digest
    assert served.load("a1", adapters[1]).slot != replaced.slot
