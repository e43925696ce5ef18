"""A seeded LoRA adapter on SmolLM2-135M: the served adapter changes the greedy output and
gives exactly the tokens of the same adapter fused into the weights with mlx-lm (the tiny
checkpoint's version, tests/engines/lora/test_adapters.py, also checks mixed batches)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx.utils import tree_unflatten
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import load

from engines.lora.adapter_set import AdapterSet
from engines.lora.random_adapter import write_random_adapter
from tests.engines.lora.test_adapters import greedy

PROMPT = [[1, 504, 3000, 28, 7, 95, 42, 17]]
STEPS = 8
pytestmark = [pytest.mark.smollm2, pytest.mark.openblas_child]


def test_a_smollm2_adapter_is_what_mlx_lm_fuses(smollm2_model_path: Path, tmp_path: Path):
    path = str(smollm2_model_path)
    model, _ = load(path)
    base = greedy(model, PROMPT, STEPS)
    adapter = write_random_adapter(model, tmp_path / "a", seed=7, rank=4)
    served = AdapterSet(model)
    served.load("a", adapter)
    served.use(["a"])
    ours = greedy(model, PROMPT, STEPS)
    assert ours != base
    reference = load_adapters(load(path)[0], str(adapter))
    fused = [(name, module.fuse()) for name, module in reference.named_modules()
             if hasattr(module, "fuse")]  # fmt: skip
    reference.update_modules(tree_unflatten(fused))
    assert greedy(reference, PROMPT, STEPS) == ours
