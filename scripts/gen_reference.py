"""Regenerate (or check) docs/reference.md from the code's own definitions.

    .venv/bin/python scripts/gen_reference.py          # rewrite the generated tables
    .venv/bin/python scripts/gen_reference.py --check  # exit 1 if they are stale

docs/reference.md holds cog blocks (cogapp) that call the ``*_table`` functions
below; ``tests/test_reference.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_descriptions as described  # noqa: E402
import reference_sources as sources  # noqa: E402

REPO = sources.REPO
REFERENCE = REPO / "docs" / "reference.md"
REGENERATE = ".venv/bin/python scripts/gen_reference.py"
UNDESCRIBED = "**undescribed**"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def code(text: str) -> str:
    return f"`{text}`" if text else "—"


# -- flags and environment ----------------------------------------------------------


def flags_table() -> str:
    env_of = {dest: [var] for var, dest in sources.config_env_vars().items()}
    env_of.update(flag_env_read_elsewhere())
    rows = [(code(flag.names), ", ".join(map(code, env_of.get(flag.dest, []))) or "—",
             flag_default(flag.dest), flag.help) for flag in sources.flags()]  # fmt: skip
    return table(("flag", "env var", "default", "meaning"), rows)


def flag_env_read_elsewhere() -> dict[str, list[str]]:
    """Flags whose env vars are read by their own module (listed in the env table too)."""
    from mlxcel_plugin.link.protocol.secret import ENV_SECRET, ENV_SECRET_FILE

    return {"cluster_secret_file": [ENV_SECRET_FILE, ENV_SECRET]}


def flag_default(dest: str) -> str:
    from mlxcel_plugin.config import PREFIX_CACHE_BYTES_FLAG, ServerConfig
    from mlxcel_plugin.engine_api import PrefixCacheConfig

    if dest == PREFIX_CACHE_BYTES_FLAG:
        return code(defaults_of(PrefixCacheConfig)["max_bytes"])
    return code(defaults_of(ServerConfig).get(dest, ""))


@cache
def defaults_of(cls: type) -> dict[str, str]:
    return {key.name: key.default for key in sources.section_keys(cls)}


def env_table() -> str:
    """Variables read outside the flag table: each needs a line in ENV_DESCRIPTIONS."""
    flagged = sources.config_env_vars()
    rows = [(code(name), describe_env(name)) for name in sorted(sources.product_env_names())
            if name not in flagged]  # fmt: skip
    return table(("env var", "meaning"), rows)


def load_test_env_table() -> str:
    rows = [(code(name), describe_env(name)) for name in sorted(sources.load_test_env_names())
            if name.startswith("MLXCEL_LOCUST_")]  # fmt: skip
    return table(("env var", "meaning"), rows)


def describe_env(name: str) -> str:
    return described.ENV_DESCRIPTIONS.get(name, UNDESCRIBED)


def undescribed_env_names() -> list[str]:
    names = {**sources.product_env_names(), **sources.load_test_env_names()}
    flagged = set(sources.config_env_vars())
    return sorted(n for n in names if n not in flagged and n not in described.ENV_DESCRIPTIONS)


# -- TOML -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    name: str
    cls: str  # "module:Class"
    roles: str


SECTIONS = (
    Section("engine", "mlxcel_plugin.engine_api:EngineConfig", "hybrid, prefill, decode"),
    Section("prefix_cache", "mlxcel_plugin.engine_api:PrefixCacheConfig",
            "hybrid, prefill, decode (`local_prefill_tokens`: router)"),
    Section("speculative", "mlxcel_plugin.speculative.settings:SpeculativeConfig",
            "hybrid, decode"),
    Section("prefill_scheduler", "mlxcel_plugin.scheduling:PrefillSchedulerConfig", "prefill"),
    Section("decode_scheduler", "mlxcel_plugin.scheduling:DecodeSchedulerConfig", "decode"),
    Section("transfer", "mlxcel_plugin.transfer:TransferConfig", "prefill, decode"),
    Section("node", "mlxcel_plugin.nodes.roles:NodeSettings",
            "prefill, decode (`drain_timeout_s`: every role)"),
    Section("router", "router_plugin.cluster.backend:RouterConfig", "router"),
    Section("backpressure", "router_plugin.cluster.admission:BackpressureConfig", "router"),
    Section("health", "router_plugin.cluster.health:HealthConfig", "router"),
    Section("discovery", "mlxcel_plugin.discovery_api:DiscoveryConfig", "router"),
    Section("models", "router_plugin.cluster.model_pools:ModelPoolEntry",
            "router; one `[models.NAME]` table per served model: docs/models-and-adapters.md"),
)


def section_class(section: Section) -> type:
    import importlib

    module, name = section.cls.split(":")
    return getattr(importlib.import_module(module), name)


def toml_tables() -> str:
    return "\n".join(toml_table(section) for section in SECTIONS)


def toml_table(section: Section) -> str:
    rows = []
    for key in sources.section_keys(section_class(section)):
        meaning = key.comment or described.TOML_DESCRIPTIONS.get(f"{section.name}.{key.name}", "")
        rows.append((code(key.name), code(key.default), meaning))
    head = f"#### `[{section.name}]` ({section.roles})\n\n"
    return head + table(("key", "default", "meaning"), rows)


def unlisted_sections() -> list[str]:
    listed = {section.name for section in SECTIONS} | {"server"}
    return sorted(sources.sections_read_by_the_code() - listed)


# -- endpoints and metrics ------------------------------------------------------------


@cache
def apps() -> sources.Apps:
    return sources.build_apps()


def endpoints_table() -> str:
    from router_plugin.http.drain import LIVE_PATH, READY_PATH

    rows: dict[tuple[str, str], dict] = {}
    for roles, app in apps().http.items():
        found = list(sources.endpoints(app))
        if roles in ("hybrid", "router"):  # answered by the drain gate in front of the app
            found += [sources.Endpoint(path, "GET", "") for path in (READY_PATH, LIVE_PATH)]
        for endpoint in found:
            if endpoint.path in described.ENDPOINTS_NOT_LISTED:
                continue
            row = rows.setdefault((endpoint.path, endpoint.methods), {"roles": [], "what": ""})
            row["roles"].append(roles)
            row["what"] = row["what"] or endpoint.summary
    body = [(code(f"{methods} {path}"), ", ".join(row["roles"]),
             describe_endpoint(f"{methods} {path}", path, row))
            for (path, methods), row in sorted(rows.items())]  # fmt: skip
    return table(("endpoint", "roles", "what"), body)


def describe_endpoint(route: str, path: str, row: dict) -> str:
    table = described.ENDPOINT_DESCRIPTIONS
    return table.get(route) or table.get(path) or row["what"] or UNDESCRIBED


def metrics_table() -> str:
    rows: dict[str, dict] = {}
    for role, registry in apps().registries.items():
        for metric in sources.metrics(registry):
            row = rows.setdefault(metric.name, {"metric": metric, "roles": [], "helps": []})
            row["roles"].append(role)
            if metric.help not in row["helps"]:
                row["helps"].append(metric.help)
    body = [(code(name), row["metric"].kind, ", ".join(row["roles"]),
             ", ".join(row["metric"].labels) or "—", " / ".join(row["helps"]))
            for name, row in sorted(rows.items())]  # fmt: skip
    return table(("metric", "type", "roles", "labels", "what"), body)


# -- cog ------------------------------------------------------------------------------


def generated(text: str) -> str:
    from cogapp import Cog

    return Cog().process_string(text, fname=str(REFERENCE))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    current = REFERENCE.read_text(encoding="utf-8")
    fresh = generated(current)
    if args.check:
        stale = fresh != current
        print(f"{REFERENCE.relative_to(REPO)} is stale: run {REGENERATE}" if stale else "ok")
        return 1 if stale else 0
    REFERENCE.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
