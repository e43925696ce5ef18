"""docs/reference.md is what the code defines: flags, env vars, TOML keys, endpoints, metrics.

The tables are generated (``scripts/gen_reference.py``, cog blocks in the page);
these tests fail when the page is stale, when an environment variable has no
description, or when the code reads a TOML section the generator does not list.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gen_reference.py"


def load_generator():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gen_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module  # the cog blocks import it by this name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ref():
    return load_generator()


def test_reference_is_generated_from_the_code(ref):
    current = ref.REFERENCE.read_text(encoding="utf-8")
    assert ref.generated(current) == current, (
        f"docs/reference.md is stale (a flag, env var, TOML key, endpoint or metric changed): "
        f"run {ref.REGENERATE}"
    )


def test_every_environment_variable_is_described(ref):
    missing = ref.undescribed_env_names()
    assert not missing, (
        f"environment variables without a description: {missing}; add each to ENV_DESCRIPTIONS "
        f"in scripts/reference_descriptions.py, then run {ref.REGENERATE}"
    )


def test_every_endpoint_is_described(ref):
    missing = [row for row in ref.endpoints_table().splitlines() if ref.UNDESCRIBED in row]
    assert not missing, (
        f"endpoints without a description: {missing}; give the route an OpenAPI summary or its "
        f"handler a docstring, or add it to ENDPOINT_DESCRIPTIONS in "
        f"scripts/reference_descriptions.py, then run {ref.REGENERATE}"
    )


def test_every_toml_section_the_code_reads_is_listed(ref):
    missing = ref.unlisted_sections()
    assert not missing, (
        f"TOML sections read by the code but not in SECTIONS of scripts/gen_reference.py: "
        f"{missing}; add them, then run {ref.REGENERATE}"
    )


def test_the_tables_hold_what_the_code_defines(ref):
    assert "`--cluster-secret-file`" in ref.flags_table()
    assert "`MLXCEL_DECODE_ALLOWLIST`" in ref.env_table()
    assert "`ping_timeout_s` | `1.5`" in ref.toml_tables()
    endpoints = ref.endpoints_table()
    assert "`GET /router/stats` | router |" in endpoints
    assert "`GET /health/live` | hybrid, router, prefill, decode |" in endpoints
    metrics = ref.metrics_table()
    assert "`mlxcel:router_requests_total` | counter | router | outcome |" in metrics
    assert "`vllm:num_requests_waiting` | gauge | prefill, decode |" in metrics


def test_a_new_flag_changes_the_table(ref, monkeypatch):
    from mlxcel_plugin import cli

    make_parser = cli.make_parser

    def with_extra() -> argparse.ArgumentParser:
        parser = make_parser()
        parser.add_argument("--brand-new-flag", help="something new")
        return parser

    monkeypatch.setattr(cli, "make_parser", with_extra)
    assert "| `--brand-new-flag` | — | — | something new |" in ref.flags_table()


def test_an_undescribed_variable_is_reported(ref, monkeypatch):
    names = {"MLXCEL_SOMETHING_NEW": ["x.py"]}
    monkeypatch.setattr(ref.sources, "product_env_names", lambda: names)
    assert ref.undescribed_env_names() == ["MLXCEL_SOMETHING_NEW"]
    assert "**undescribed**" in ref.env_table()


def test_field_comments_are_read_above_and_beside(ref):
    from mlxcel_plugin.transfer import TransferConfig

    comments = ref.sources.field_comments(TransferConfig)
    assert comments["parallelism"] == "links per handoff that LayerParallel may use"
    assert comments["allow_lossy"].startswith("Lossy codecs change the tokens")
