"""``--adapter NAME=PATH[@BASE]``: a LoRA adapter a node serves under ``NAME``.

Core side (no MLX): the spec is parsed and checked here; the engine loads the
files (``engines/lora``). ``BASE``, when given, must be the model the node
serves: an adapter is trained on one base and means nothing over another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlxcel_plugin.errors import ConfigError


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    base: str | None = None


def parse_adapter_spec(text: str) -> AdapterSpec:
    name, sep, rest = text.partition("=")
    path, _, base = rest.partition("@")
    if not sep or not name.strip() or not path.strip():
        raise ConfigError(f"--adapter {text!r} is not NAME=PATH[@BASE]")
    if not Path(path.strip()).is_dir():
        raise ConfigError(f"--adapter {text!r}: {path.strip()} is not a directory")
    return AdapterSpec(name.strip(), path.strip(), base.strip() or None)


def check_bases(specs: list[AdapterSpec], served_model: str | None) -> None:
    for spec in specs:
        if spec.base is not None and served_model is not None and spec.base != served_model:
            raise ConfigError(f"--adapter {spec.name}: its base {spec.base!r} is not the "
                              f"model this node serves ({served_model!r})")  # fmt: skip
