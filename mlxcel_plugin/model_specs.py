"""``--model NAME=PATH`` (repeatable) and ``[models.NAME] model = PATH``: the models a node serves.

Core side (no MLX): specs are parsed and checked at start, before any model
loads; a plain ``--model PATH`` stays one model named as before (the
directory's name, or ``--served-model-name``). Several models are served by a
hybrid node (docs/models-and-adapters.md); the weights' size, for the memory bound, is the
sum of the checkpoint's ``*.safetensors`` files.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel_plugin.errors import ConfigError

# A model name as a request's ``model`` carries it: no "=" (the spec's separator), no "/"
# (a path is not a name), no spaces.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")
MODEL_KEY = "model"  # [models.NAME] model = PATH, the router's spelling


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str

    def as_flag(self) -> str:
        return f"{self.name}={self.path}"


def _checked_dir(path: str, text: str) -> str:
    if not path:
        raise ConfigError(f"--model {text!r} is not NAME=PATH or PATH")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"--model {text!r}: {path} is not a checkpoint directory "
                          "(no config.json)")  # fmt: skip
    return path


def parse_model_spec(text: str) -> ModelSpec | str:
    """``NAME=PATH`` -> a spec; a plain ``PATH`` (an existing directory) -> the path itself."""
    text = text.strip()
    name, sep, path = text.partition("=")
    if not sep or Path(text).is_dir():
        return text
    name, path = name.strip(), path.strip()
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"--model {text!r}: {name!r} is not a model name "
                          "(letters, digits and . _ : @ + -)")  # fmt: skip
    return ModelSpec(name, _checked_dir(path, text))


def parse_model_specs(texts: Iterable[str]) -> tuple[ModelSpec | str, ...]:
    """Each ``--model`` value parsed; a name given twice is an error."""
    parsed = tuple(parse_model_spec(text) for text in texts)
    seen: set[str] = set()
    for spec in parsed:
        if isinstance(spec, ModelSpec):
            if spec.name in seen:
                raise ConfigError(f"--model: the name {spec.name!r} is given twice")
            seen.add(spec.name)
    if len(parsed) > 1 and any(isinstance(spec, str) for spec in parsed):
        plain = next(spec for spec in parsed if isinstance(spec, str))
        raise ConfigError(f"--model {plain!r}: with several models each needs a name: "
                          "NAME=PATH")  # fmt: skip
    return parsed


def specs_from_toml(section: Mapping[str, Any]) -> tuple[ModelSpec, ...]:
    """``[models.NAME] model = PATH`` tables, as a node reads them."""
    specs = []
    for name, table in section.items():
        if not isinstance(table, Mapping) or MODEL_KEY not in table:
            raise ConfigError(f"[models.{name}] needs model = PATH")
        unknown = sorted(set(table) - {MODEL_KEY})
        if unknown:
            raise ConfigError(f"[models.{name}]: unknown key(s) {', '.join(unknown)} on a "
                              "node (known: model)")  # fmt: skip
        specs.append(f"{name}={table[MODEL_KEY]}")
    return tuple(spec for spec in parse_model_specs(specs) if isinstance(spec, ModelSpec))


def from_flags(texts: Iterable[str]) -> tuple[ModelSpec, ...]:
    """Normalized ``NAME=PATH`` strings (``ServerConfig.models``) back to specs."""
    return tuple(spec for spec in parse_model_specs(texts) if isinstance(spec, ModelSpec))


def checkpoint_bytes(path: str | Path) -> int:
    """The weights' size as stored: every ``*.safetensors`` file of the checkpoint."""
    return sum(file.stat().st_size for file in Path(path).glob("*.safetensors"))
