"""Tool-call parsers: mlx-lm's for the model families it covers, ours where it has none.

mlx-lm picks a parser (``mlx_lm/tool_parsers/<name>.py``) from the
tokenizer config's ``tool_parser_type``, else from its model module's
``TOKENIZER_DEFAULTS`` (by ``model_type``), else from the chat template's
markup, else from the vocabulary; we pick the same way. A template it
does not recognise (the embedded SmolLM2's, Hermes/Qwen JSON in
``<tool_call>``) gets ours (``tool_calls.py``).

Layering (docs/design.md): the core never imports mlx-lm, because importing
the ``mlx_lm`` package imports MLX. Its parser modules, and the module that
infers which one applies, import neither MLX nor anything of mlx-lm's but
each other (json, regex, ast, transformers), so they are loaded here from
mlx-lm's installed files under a private package name, without running
``mlx_lm/__init__.py``; a model module (which imports MLX) is only parsed.
tests/mlxcel_plugin/text/test_tool_parsers.py checks that MLX stays unimported.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import json
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from mlxcel_plugin.text.stream_filter import TOOL_CLOSE, TOOL_OPEN, FilterMarkers
from mlxcel_plugin.text.tool_calls import ToolCall, parse_tool_call, tool_call

log = logging.getLogger(__name__)
_PARSERS_PACKAGE = "_mlxcel_mlx_lm_tool_parsers"
_INFERENCE_MODULE = "_mlxcel_mlx_lm_tokenizer_utils"
OURS = "mlxcel_json"


@dataclass(frozen=True)
class ToolParser:
    """One family's tool-call markup and the parser of the text between it."""

    name: str  # mlx-lm's parser module, or OURS
    start: str
    end: str | None  # None: the call runs to the end of the output
    parse: Callable[[str, Any], Any] | None = None  # mlx-lm's parse_tool_call(text, tools)

    def calls(self, body: str, first_index: int, tools: Any = None) -> list[ToolCall] | None:
        """The calls in one body (markup stripped); None when it holds none."""
        if self.parse is None:
            call = parse_tool_call(body, first_index)
            return None if call is None else [call]
        try:
            parsed = self.parse(body, tools)
        except (ValueError, KeyError, TypeError, SyntaxError) as exc:
            log.debug("%s could not parse a tool call (%s)", self.name, exc)
            return None
        found = parsed if isinstance(parsed, list) else [parsed]
        calls = [_from_mlx_lm(c, first_index + i) for i, c in enumerate(found)]
        return None if not calls or None in calls else calls

    def markers(self, openers: tuple[str, ...] = ()) -> FilterMarkers:
        """Stream-filter markers: this family's pair, ours, and lone tool tokens."""
        pairs = {self.start: self.end}
        pairs.setdefault(TOOL_OPEN, TOOL_CLOSE)
        return FilterMarkers(tool_pairs=tuple(pairs.items())).with_tool_openers(openers)


def _from_mlx_lm(call: Any, index: int) -> ToolCall | None:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return tool_call(index, call["name"], arguments)


OURS_PARSER = ToolParser(OURS, TOOL_OPEN, TOOL_CLOSE)


def tool_parser_for(hf_tokenizer: Any) -> ToolParser:
    """The parser mlx-lm would pick for this tokenizer, else ours."""
    config = getattr(hf_tokenizer, "init_kwargs", None) or {}
    name = config.get("tool_parser_type") or _model_type_default(hf_tokenizer)
    try:
        if name is None:
            infer = _mlx_lm_inference()
            name = infer(hf_tokenizer) if infer is not None else None
        module = _mlx_lm_parser(name) if name else None
    except (ImportError, OSError, AttributeError) as exc:
        log.warning("mlx-lm's tool parser %r could not be loaded (%s); using ours", name, exc)
        module = None
    if module is None:
        return OURS_PARSER
    end = module.tool_call_end or None
    return ToolParser(name, module.tool_call_start, end, module.parse_tool_call)


def _model_type_default(hf_tokenizer: Any) -> str | None:
    """``TOKENIZER_DEFAULTS["tool_parser_type"]`` of mlx-lm's module for this model type."""
    checkpoint = Path(str(getattr(hf_tokenizer, "name_or_path", "") or "."))
    try:
        model_type = json.loads((checkpoint / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    root = _mlx_lm_dir()
    if not isinstance(model_type, str) or not model_type.isidentifier() or root is None:
        return None
    source = root / "models" / f"{model_type}.py"
    if not source.is_file():
        return None
    for node in ast.parse(source.read_text()).body:  # parsed, never imported: it imports MLX
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "TOKENIZER_DEFAULTS" for t in targets):
            defaults = ast.literal_eval(node.value)
            return defaults.get("tool_parser_type") if isinstance(defaults, dict) else None
    return None


def _mlx_lm_dir() -> Path | None:
    spec = importlib.util.find_spec("mlx_lm")  # a top-level find runs no package code
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _mlx_lm_parser(name: str) -> ModuleType | None:
    if not name.isidentifier():
        return None
    root = _mlx_lm_dir()
    if root is None or not (root / "tool_parsers" / f"{name}.py").is_file():
        return None
    _ensure_package(root / "tool_parsers")
    return importlib.import_module(f"{_PARSERS_PACKAGE}.{name}")


def _ensure_package(directory: Path) -> None:
    """mlx-lm's tool_parsers folder as a package of our own (its siblings import each other)."""
    if _PARSERS_PACKAGE in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        _PARSERS_PACKAGE, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PARSERS_PACKAGE] = module
    spec.loader.exec_module(module)


@functools.cache
def _mlx_lm_inference() -> Callable[[Any], str | None] | None:
    """mlx-lm's ``_infer_tool_parser`` (tokenizer_utils.py: transformers and stdlib only)."""
    root = _mlx_lm_dir()
    path = None if root is None else root / "tokenizer_utils.py"
    if path is None or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(_INFERENCE_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "_infer_tool_parser", None)


def template_of(hf_tokenizer: Any) -> str:
    """The tokenizer's default chat template text ('' when none)."""
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("default") or next(iter(template.values()), "")
    return template if isinstance(template, str) else ""
