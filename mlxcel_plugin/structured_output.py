"""OpenAI ``response_format`` → a grammar spec that travels with the request (engine-neutral).

The spec is canonical JSON text in ``SamplingParams.grammar``: it rides in the
REQUEST frame's sampling and in the handoff header's sampling state, so a
decode node builds the same grammar as the prefill node and replays the
tokens generated so far into a fresh matcher (docs/structured-output.md).
Grammars are llguidance's: its JSON-schema compiler runs here, at the front,
so a schema it cannot serve is a 400 before anything is queued; the token
masks are computed on the engine side (``engines/grammar.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import llguidance

from mlxcel_plugin.errors import InvalidRequestError

PARAM = "response_format"
# The spec travels in frame headers (1 MiB each, with the rest of the request).
MAX_GRAMMAR_CHARS = 256 * 1024
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
# Compact JSON: no whitespace between tokens, so a model cannot loop on blanks.
_COMPILE_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must be: any JSON object, or JSON valid under ``schema``.

    ``strict`` (OpenAI's ``json_schema.strict``): every keyword of the schema
    must be enforced, so one the grammar engine does not implement is refused;
    otherwise such keywords are ignored (the output may then not validate).
    """

    kind: str  # "json_object" | "json_schema" | "tool_call" (mlxcel_plugin/tool_choice.py)
    schema: dict[str, Any] | None = None
    strict: bool = False
    name: str | None = None
    # "tool_call": the model's tool-call markup around the JSON call, e.g. <tool_call>...
    wrap: tuple[str, str] | None = None

    def to_text(self) -> str:
        data = {"type": self.kind, "schema": self.schema, "strict": self.strict, "name": self.name}
        if self.wrap is not None:
            data["wrap"] = list(self.wrap)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> GrammarSpec:
        """A spec from a link peer: parsed and checked like a client's (InvalidRequestError)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"grammar spec is not JSON: {exc}", param=PARAM) from None
        if not isinstance(data, dict):
            raise InvalidRequestError("grammar spec must be an object", param=PARAM)
        kind = data.get("type")
        if kind == "json_object":
            return cls("json_object")
        if kind == "tool_call":
            return cls(kind, _schema(data.get("schema")), name=data.get("name"),
                       wrap=_wrap(data.get("wrap")))  # fmt: skip
        if kind != "json_schema":
            raise InvalidRequestError(f"unknown grammar kind {kind!r:.40}", param=PARAM)
        return cls("json_schema", _schema(data.get("schema")), bool(data.get("strict")),
                   data.get("name"))

    def llguidance_grammar(self) -> str:
        """The llguidance grammar (its JSON) for this spec."""
        schema = {"type": "object"} if self.schema is None else self.schema
        if self.wrap is not None:
            return _tool_call_grammar(schema, self.wrap)
        overrides = {"lenient": not self.strict}
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=_COMPILE_DEFAULTS, overrides=overrides
        )

    def check(self) -> None:
        """Refuse a schema the grammar engine cannot compile (InvalidRequestError, a 400)."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            self.llguidance_grammar()
        )
        if is_error:
            raise InvalidRequestError(f"'{PARAM}': the schema cannot be enforced: "
                                      f"{messages[0] if messages else 'invalid'}", param=PARAM)


def parse_response_format(value: Any) -> str | None:
    """A request's ``response_format`` → the spec text for ``SamplingParams.grammar``.

    None (absent or ``{"type": "text"}``) means unconstrained.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("expected an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        spec = GrammarSpec("json_object")
    elif kind == "json_schema":
        spec = _json_schema_spec(value.get("json_schema"))
    else:
        raise _bad(f"type {kind!r:.40} is not supported; use 'text', 'json_object' "
                   "or 'json_schema'")
    spec.check()
    text = spec.to_text()
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _bad(f"the schema is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
    return text


def _json_schema_spec(value: Any) -> GrammarSpec:
    if not isinstance(value, dict):
        raise _bad("'json_schema' must be an object with 'name' and 'schema'", ".json_schema")
    name = value.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise _bad("'name' must be 1-64 letters, digits, '_' or '-'", ".json_schema.name")
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("'strict' must be a boolean", ".json_schema.strict")
    return GrammarSpec("json_schema", _schema(value.get("schema")), bool(strict), name)


def _schema(value: Any) -> dict[str, Any] | None:
    # OpenAI lets ``schema`` be left out; then any JSON object will do.
    if value is not None and not isinstance(value, dict):
        raise _bad("'schema' must be a JSON Schema object", ".json_schema.schema")
    return value


def _wrap(value: Any) -> tuple[str, str]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        raise InvalidRequestError("a tool_call grammar spec needs 'wrap': [open, close]",
                                  param="tool_choice")  # fmt: skip
    return value[0], value[1]


def _tool_call_grammar(schema: dict[str, Any], wrap: tuple[str, str]) -> str:
    """Lark: ``open`` ``{"name":NAME,"arguments":ARGS}`` ``close``, one branch per tool.

    ``schema["calls"]`` maps each allowed name to its arguments' schema. The
    call's keys are literals, so ``name`` comes first whatever order the
    canonical (sorted) spec text gives them; the arguments are compact JSON
    under the tool's schema, keywords the engine lacks ignored.
    """
    options = {"x-guidance": {**_COMPILE_DEFAULTS, "lenient": True}}
    lines = [f"start: {json.dumps(wrap[0])} call {json.dumps(wrap[1])}"]
    calls = dict(schema.get("calls") or {})
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(calls))))
    for i, (name, arguments) in enumerate(calls.items()):
        head = json.dumps({"name": name}, separators=(",", ":"))[:-1] + ',"arguments":'
        lines.append(f'call_{i}: {json.dumps(head)} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps({**arguments, **options})}")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")


def _bad(message: str, where: str = "") -> InvalidRequestError:
    return InvalidRequestError(f"'{PARAM}{where}': {message}", param=PARAM)
