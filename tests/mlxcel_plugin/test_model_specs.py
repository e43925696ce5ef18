"""``--model`` specs and ``[models.NAME]`` tables on a node: parsed into ``model``/``models``,
bad ones refused at start with a message naming the spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel_plugin.config import build_config
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.model_specs import ModelSpec, checkpoint_bytes, parse_model_specs


def checkpoint(root: Path, name: str, weights: int = 10) -> str:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"\0" * weights)
    return str(path)


def test_one_plain_path_is_todays_single_model(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, "m")
    config = build_config({"model": [path]}, env={})
    assert (config.model, config.served_model_name, config.models) == (path, None, ())


def test_a_path_with_an_equals_sign_stays_a_path(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, "a=b")
    assert parse_model_specs([path]) == (path,)


def test_one_named_model_is_served_by_its_name(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, "m")
    config = build_config({"model": [f"fox={path}"]}, env={})
    assert (config.model, config.served_model_name, config.models) == (path, "fox", ())


def test_several_models_the_first_is_the_default(tmp_path: Path) -> None:
    a, b = checkpoint(tmp_path, "a"), checkpoint(tmp_path, "b")
    config = build_config({"model": [f"x={a}", f"y={b}"], "max_loaded_models": 1}, env={})
    assert (config.model, config.served_model_name) == (a, "x")
    assert config.models == (f"x={a}", f"y={b}") and config.max_loaded_models == 1


def test_a_nodes_toml_tables_match_the_routers_spelling(tmp_path: Path) -> None:
    a, b = checkpoint(tmp_path, "a"), checkpoint(tmp_path, "b")
    toml = tmp_path / "node.toml"
    toml.write_text(f'[server]\nmodel_wait_s = 2.5\n[models.x]\nmodel = "{a}"\n'
                    f'[models.y]\nmodel = "{b}"\n')  # fmt: skip
    config = build_config({"distributed_config": str(toml)}, env={})
    assert config.models == (f"x={a}", f"y={b}") and config.model_wait_s == 2.5
    toml.write_text(f'[models.x]\nmodel = "{a}"\nprefill_peers = ["h:1"]\n')
    with pytest.raises(ConfigError, match=r"\[models.x\]: unknown key\(s\) prefill_peers"):
        build_config({"distributed_config": str(toml)}, env={})


@pytest.mark.parametrize(("extra", "message"), [
    ({"served_model_name": "other"}, "name the model twice"),
    ({"adapters": ["ad=/tmp"]}, "--adapter / --enable-lora serve one model's adapters"),
    ({"max_loaded_models": -1}, "--max-loaded-models must be >= 0"),
    ({"role": "prefill", "serving_bind": "127.0.0.1:9"}, "--node-role prefill serves one model"),
])  # fmt: skip
def test_conflicting_settings_are_refused(tmp_path: Path, extra, message) -> None:
    a, b = checkpoint(tmp_path, "a"), checkpoint(tmp_path, "b")
    with pytest.raises(ConfigError, match=message):
        build_config({"model": [f"x={a}", f"y={b}"], **extra}, env={})


def test_a_plain_path_among_named_ones_is_refused(tmp_path: Path) -> None:
    a = checkpoint(tmp_path, "a")
    with pytest.raises(ConfigError, match="with several models each needs a name"):
        parse_model_specs([f"x={a}", a])
    assert parse_model_specs([f"x={a}"]) == (ModelSpec("x", a),)


def test_the_weights_size_is_the_safetensors_files(tmp_path: Path) -> None:
    path = Path(checkpoint(tmp_path, "a", weights=1000))
    (path / "model-2.safetensors").write_bytes(b"\0" * 24)
    (path / "tokenizer.json").write_bytes(b"\0" * 500)
    assert checkpoint_bytes(path) == 1024
