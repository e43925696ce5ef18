"""What docs/reference.md lists, read from the code's own definitions.

Flags from the argparse parser, TOML keys from the config dataclasses (their
field comments), endpoints from the apps the roles really build (hybrid and
router on the ``fake`` engine, the nodes' ops server), metrics from the
registries of those apps and of real prefill and decode node objects, and
environment variables by a scan of the product's source for ``MLXCEL_*``
names. Nothing here starts a server or loads a model.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import re
import tempfile
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("mlxcel_plugin", "engines", "router_plugin")
LOAD_TEST_FILES = ("loadtests/locustfile.py",)
ENV_NAME = re.compile(r"^MLXCEL_[A-Z0-9_]+$")
BUILTIN_PLUGINS = {"MLXCEL_PLUGINS": "core,mlx_engines,router"}
# A secret the generator's router and prefill node are built with; never used on a link.
THROWAWAY_SECRET = "00" * 32


# -- flags --------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    names: str  # "--api-key KEY"
    dest: str
    help: str


def flags() -> list[Flag]:
    from mlxcel_plugin.cli import make_parser

    found = []
    for action in make_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        choices = f" {{{','.join(action.choices)}}}" if action.choices else ""
        names = ", ".join(action.option_strings) + choices
        found.append(Flag(names, action.dest, action.help or ""))
    return found


# -- environment variables ----------------------------------------------------------


def env_names_in(paths: list[Path]) -> dict[str, list[str]]:
    """``MLXCEL_*`` string constants in ``paths`` -> the files that name them."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if ENV_NAME.match(node.value):
                    found.setdefault(node.value, []).append(str(path.relative_to(REPO)))
    return found


def product_sources() -> list[Path]:
    return sorted(p for pkg in PRODUCT_PACKAGES for p in (REPO / pkg).rglob("*.py"))


def product_env_names() -> dict[str, list[str]]:
    return env_names_in(product_sources())


def load_test_env_names() -> dict[str, list[str]]:
    return env_names_in([REPO / name for name in LOAD_TEST_FILES])


def config_env_vars() -> dict[str, str]:
    """Env var -> the ``ServerConfig`` field it sets (the flag's ``dest``)."""
    from mlxcel_plugin import config

    return {**config.ENV_VARS, config.PREFIX_CACHE_BYTES_ENV: config.PREFIX_CACHE_BYTES_FLAG}


# -- TOML keys ----------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    name: str
    default: str
    comment: str  # the field's own comment in the code ("" when it has none)


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the ``#`` lines just above it and the one at its line's end."""
    lines, _ = inspect.getsourcelines(cls)
    comments = _trailing_comments("".join(lines))
    body = ast.parse(inspect.getsource(cls)).body[0]
    found = {}
    for node in body.body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above = _comment_block_above(lines, node.lineno - 1)
            parts = [*above, comments.get(node.lineno, "")]
            found[node.target.id] = " ".join(p for p in parts if p)
    return found


def _trailing_comments(source: str) -> dict[int, str]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("# ").strip() for t in tokens if t.type == tokenize.COMMENT}


def _comment_block_above(lines: list[str], index: int) -> list[str]:
    block: list[str] = []
    while index > 0 and lines[index - 1].strip().startswith("#"):
        index -= 1
        block.insert(0, lines[index].strip().lstrip("# ").strip())
    return block


def section_keys(cls: type, skip: frozenset[str] = frozenset()) -> list[Key]:
    comments = field_comments(cls)
    keys = []
    for spec in dataclasses.fields(cls):
        default = _default_of(spec)
        if spec.name in skip or default is None:
            continue
        keys.append(Key(spec.name, default, comments.get(spec.name, "")))
    return keys


def _default_of(spec: dataclasses.Field) -> str | None:
    """The default as TOML would write it; None for a nested section (its own table)."""
    if spec.default is not dataclasses.MISSING:
        value = spec.default
    elif spec.default_factory is not dataclasses.MISSING:
        value = spec.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return None
    if isinstance(value, frozenset | tuple):
        value = sorted(value) if isinstance(value, frozenset) else list(value)
    return json.dumps(value) if isinstance(value, str | bool | list) else _number(value)


def _number(value: Any) -> str:
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return "none" if value is None else str(value)


def sections_read_by_the_code() -> set[str]:
    """TOML section names the product reads: ``.section("x")`` and ``"[x]"`` error labels."""
    found = set()
    for path in product_sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            if re.fullmatch(r"\[[a-z_]+\]", node.value):
                found.add(node.value[1:-1])
        found |= set(re.findall(r"\.section\(\"([a-z_]+)\"\)", path.read_text(encoding="utf-8")))
    return found


# -- the apps: endpoints and metrics ------------------------------------------------


@dataclass
class Apps:
    """The HTTP apps and metric registries each role serves, built without serving."""

    http: dict[str, Any] = field(default_factory=dict)  # role -> ASGI app with .routes
    registries: dict[str, Any] = field(default_factory=dict)  # role -> CollectorRegistry


def build_apps() -> Apps:
    from mlxcel_plugin.plugins import load_plugins

    registry = load_plugins(env=BUILTIN_PLUGINS)
    apps = Apps()
    with tempfile.TemporaryDirectory() as model_dir:
        write_tokenizer_only_model(Path(model_dir))
        for role, app in _front_apps(model_dir, registry).items():
            apps.http[role] = app
            apps.registries[role] = app.state.front.metrics.registry
        apps.registries["hybrid (several models)"] = _several_models_registry(model_dir, registry)
    for role, node in _nodes(registry).items():
        apps.registries[role] = node.metrics.registry
    apps.http["prefill, decode"] = _ops_app()
    return apps


def write_tokenizer_only_model(path: Path) -> None:
    """A three-word tokenizer and a config: all a router (or a ``fake`` hybrid) reads."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, "</s>": 2}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)  # fmt: skip
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))


def _front_apps(model_dir: str, registry: Any) -> dict[str, Any]:
    from mlxcel_plugin.config import build_config
    from router_plugin.roles import make_hybrid_app, make_router_app

    env = {"MLXCEL_CLUSTER_SECRET": THROWAWAY_SECRET}
    hybrid = build_config({"engine": "fake", "model": model_dir}, env={})
    router = build_config({"role": "router", "model": model_dir, "prefill_peers": "127.0.0.1:1",
                           "decode_peers": "127.0.0.1:2"}, env=env)  # fmt: skip
    return {"hybrid": make_hybrid_app(hybrid, registry),
            "router": make_router_app(router, registry, env)}  # fmt: skip


def _several_models_registry(model_dir: str, registry: Any) -> Any:
    """A hybrid node serving several models: its routes are a hybrid's, its metrics more."""
    from mlxcel_plugin.config import build_config
    from router_plugin.http.node_models import make_models_hybrid_app

    config = build_config({"engine": "fake", "model": [f"a={model_dir}", f"b={model_dir}"]},
                          env={})  # fmt: skip
    return make_models_hybrid_app(config, registry).apps["a"].state.front.metrics.registry


def _nodes(registry: Any) -> dict[str, Any]:
    from mlxcel_plugin.config import ServerConfig
    from mlxcel_plugin.link.protocol.secret import ClusterSecret
    from mlxcel_plugin.nodes import roles
    from mlxcel_plugin.nodes.decode_node import DecodeNode, DecodeNodeParts
    from mlxcel_plugin.nodes.handoff_sender import DecodeLinks
    from mlxcel_plugin.nodes.prefill_node import PrefillNode, PrefillNodeParts

    config = ServerConfig(role="prefill", engine="fake", serving_bind="127.0.0.1:1")
    transfer = roles.transfer_config(config)
    scheduler = roles.prefill_scheduler_config(config, transfer)
    engine = registry.get("engine", "fake")(None, roles.prefill_engine_config(config, scheduler))
    prefill = PrefillNodeParts(engine=engine, scheduler_config=scheduler, transfer_config=transfer,
                               strategies=registry.entries.get("transfer_strategy", {}),
                               codecs=registry.entries.get("kv_codec", {}))  # fmt: skip
    links = DecodeLinks(ClusterSecret(bytes.fromhex(THROWAWAY_SECRET)), "prefill")
    decode = DecodeNodeParts(engine=engine, codecs={},
                             scheduler_config=roles.decode_scheduler_config(config))
    return {"prefill": PrefillNode(prefill, links, "prefill"),
            "decode": DecodeNode(decode, "decode")}  # fmt: skip


def _ops_app() -> Any:
    from mlxcel_plugin.nodes.ops_server import OpsRoutes, ops_app

    return ops_app(OpsRoutes(health=dict, metrics=lambda: (b"", "text/plain")))


@dataclass(frozen=True)
class Endpoint:
    path: str
    methods: str
    summary: str


def endpoints(app: Any) -> Iterator[Endpoint]:
    """Every route of ``app``, one per method (HEAD aside), with its OpenAPI summary, else the
    first paragraph of its handler's docstring."""
    summaries = _openapi_summaries(app)
    for route in app.routes:
        endpoint = getattr(route, "endpoint", None)
        doc = (inspect.getdoc(endpoint) or "").split("\n\n")[0] if endpoint else ""
        for method in sorted(set(getattr(route, "methods", None) or ()) - {"HEAD"}):
            summary = summaries.get((route.path, method)) or doc
            yield Endpoint(route.path, method, " ".join(summary.split()))


def _openapi_summaries(app: Any) -> dict[tuple[str, str], str]:
    if not hasattr(app, "openapi"):
        return {}
    paths = app.openapi().get("paths", {})
    return {(path, method.upper()): op["summary"] for path, ops in paths.items()
            for method, op in ops.items() if op.get("summary")}  # fmt: skip


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed: counters with _total
    kind: str
    labels: tuple[str, ...]
    help: str


def metrics(registry: Any) -> Iterator[Metric]:
    declared = _declared_labels(registry)
    for family in registry.collect():
        labels = declared.get(family.name) or getattr(family, "_labelnames", None)
        labels = tuple(labels or _sample_labels(family))
        name = f"{family.name}_total" if family.type == "counter" else family.name
        yield Metric(name, family.type, labels, " ".join(family.documentation.split()))


def _sample_labels(family: Any) -> tuple[str, ...]:
    names = {label for sample in family.samples for label in sample.labels}
    return tuple(sorted(names - {"le", "quantile"}))


def _declared_labels(registry: Any) -> dict[str, tuple[str, ...]]:
    """Labels each metric declares, also before it has a sample (a counter never incremented)."""
    collectors = getattr(registry, "_collector_to_names", {})
    return {c._name: tuple(c._labelnames) for c in collectors if getattr(c, "_labelnames", ())}
