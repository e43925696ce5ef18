"""The example third-party plugin, installed like a user would, seen by real processes.

``examples/mlxcel-example-plugin`` is built and installed with pip into a
temporary ``--target`` directory; every check runs in a subprocess with that
directory on ``PYTHONPATH``, so the plugin arrives only through its
``mlxcel`` entry point — never from this source tree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxcel_plugin.local_cluster import LOOPBACK, LocalCluster, free_port, start_node
from mlxcel_plugin.plugins import load_plugins

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "mlxcel-example-plugin"
ENTRY_POINT = "example"  # [project.entry-points.mlxcel] in the example's pyproject.toml
BALANCER, CODEC = "power-of-two", "zlib"
PLUGIN_FILTERS = ("MLXCEL_PLUGINS", "MLXCEL_DISABLE_PLUGINS")
STARTUP_TIMEOUT_S = 300
EXIT_TIMEOUT_S = 120
CHAT = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 12}
LIST_NAMES = (
    "import json; from mlxcel_plugin.plugins import load_plugins; r = load_plugins(); "
    "print(json.dumps({kind: r.names(kind) for kind in ('balancer', 'kv_codec')}))"
)


def _plugin_env(target: Path, **extra: str) -> dict[str, str]:
    """This process's env without plugin filters, with the install dir on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_FILTERS}
    return {**env, "PYTHONPATH": str(target), **extra}


def _build_isolation_flags() -> list[str]:
    """``--no-build-isolation`` when this venv's setuptools can build a wheel by itself.

    setuptools < 70.1 needs the separate ``wheel`` package for ``bdist_wheel``;
    without it pip must build in an isolated env (setuptools from the index).
    """
    import setuptools

    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    own_bdist_wheel = (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None
    return ["--no-build-isolation"] if own_bdist_wheel else []


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy: an in-tree build leaves build/ and *.egg-info in the example.
    source = tmp_path_factory.mktemp("src") / EXAMPLE.name
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "tests"))
    target = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
               *_build_isolation_flags(), "--target", str(target), str(source)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def _run_python(code: str, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _registered(target: Path, tmp_path: Path, **extra: str) -> dict[str, list[str]]:
    return json.loads(_run_python(LIST_NAMES, _plugin_env(target, **extra), tmp_path))


# --- (a) discovery through the entry point ----------------------------------------


def test_installed_plugin_is_imported_from_the_install_dir(target: Path, tmp_path: Path):
    code = "import mlxcel_example_plugin as m; print(m.__file__)"
    assert Path(_run_python(code, _plugin_env(target), tmp_path).strip()).is_relative_to(target)


def test_load_plugins_lists_the_plugin_strategy_and_codec(target: Path, tmp_path: Path):
    names = _registered(target, tmp_path)
    assert BALANCER in names["balancer"] and "round-robin" in names["balancer"]
    assert CODEC in names["kv_codec"] and "lz4" in names["kv_codec"]


def test_disable_plugins_removes_them(target: Path, tmp_path: Path):
    names = _registered(target, tmp_path, MLXCEL_DISABLE_PLUGINS=ENTRY_POINT)
    assert BALANCER not in names["balancer"] and "round-robin" in names["balancer"]
    assert CODEC not in names["kv_codec"] and "lz4" in names["kv_codec"]


def test_allow_list_keeps_only_the_named_plugins(target: Path, tmp_path: Path):
    names = _registered(target, tmp_path, MLXCEL_PLUGINS=f"{ENTRY_POINT},core")
    assert names["balancer"] == [BALANCER]  # the router's built-ins are not allowed in
    assert CODEC in names["kv_codec"] and "lz4" in names["kv_codec"]


def test_without_the_install_dir_nothing_is_registered(tmp_path: Path):
    names = json.loads(_run_python(LIST_NAMES, _plugin_env(tmp_path), tmp_path))
    assert BALANCER not in names["balancer"] and CODEC not in names["kv_codec"]


# --- (b) the project's contract suites, as a plugin author runs them --------------


def test_plugin_tests_reuse_the_contract_suites(target: Path, tmp_path: Path):
    # cwd is not the example dir, so `mlxcel_example_plugin` resolves only to the install.
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
               str(EXAMPLE / "tests")]  # fmt: skip
    done = subprocess.run(
        command, env=_plugin_env(target), cwd=tmp_path, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    passed = [line for line in done.stdout.splitlines() if " PASSED" in line]
    assert not [line for line in done.stdout.splitlines() if "SKIPPED" in line]
    # The shared suites from mlxcel_plugin.testing ran, not only the plugin's own tests.
    for contract_case in (
        "test_example_power_of_two.py::test_contract[check_never_picks_unhealthy]",
        "test_example_zlib_codec.py::TestZlibCodec::test_lossless_keeps_every_bit_pattern",
        "test_example_zlib_codec.py::TestShuffleThenZlib::test_refuses_a_long_body",
    ):
        assert any(contract_case in line for line in passed), contract_case


# --- (c) a real cluster configured with the plugin's names ------------------------


def _missing(kind: str, names: set[str]) -> set[str]:
    return names - set(load_plugins().names(kind))


def _require_roles(*roles: str) -> None:
    missing = _missing("role", set(roles))
    if missing:
        pytest.skip(f"serving roles not registered yet: {sorted(missing)}")


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_path: Path) -> str:
    return str(tiny_model_path)


def _wait_exit(node, timeout_s: float = EXIT_TIMEOUT_S) -> int:
    try:
        return node.process.wait(timeout=timeout_s)
    finally:
        node.stop()


def _startup_error(node) -> str:
    """The CLI's one-line error; a traceback or a second error line fails the test."""
    log = node.log_path.read_text(errors="replace")
    assert "Traceback" not in log, node.log_tail()
    errors = [line for line in log.splitlines() if line.startswith("mlxcel-server: error:")]
    assert len(errors) == 1, node.log_tail()
    return errors[0]


def test_unknown_balancer_fails_router_startup_listing_names(
    target: Path, tmp_path: Path, tiny_dir: str
):
    _require_roles("router")
    (tmp_path / "secret").write_text("ab" * 32)
    peers = f"{LOOPBACK}:{free_port()}"
    args = ["--model", tiny_dir, "--cluster-secret-file", str(tmp_path / "secret"),
            "--prefill-peers", peers, "--decode-peers", peers,
            "--prefill-balancer", "power-of-three"]  # fmt: skip
    node = start_node("router", tmp_path, args, env=_plugin_env(target))
    assert _wait_exit(node) != 0
    error = _startup_error(node)
    assert "power-of-three" in error and BALANCER in error and "round-robin" in error


def test_unknown_codec_fails_prefill_startup_listing_names(
    target: Path, tmp_path: Path, tiny_dir: str
):
    _require_roles("prefill")
    (tmp_path / "secret").write_text("ab" * 32)
    toml = tmp_path / "cluster.toml"
    toml.write_text(f'[transfer]\ncodec = "{CODEC}"\n')
    args = ["--model", tiny_dir, "--cluster-secret-file", str(tmp_path / "secret"),
            "--decode-peers", f"{LOOPBACK}:{free_port()}", "--distributed-config", str(toml),
            "--no-warmup"]  # fmt: skip
    # With the plugin disabled, "zlib" is unknown: the name must come from the plugin.
    env = _plugin_env(target, MLXCEL_DISABLE_PLUGINS=ENTRY_POINT)
    node = start_node("prefill", tmp_path, args, env=env, serving_bind=f"{LOOPBACK}:{free_port()}")
    assert _wait_exit(node) != 0
    error = _startup_error(node)
    assert CODEC in error and "lz4" in error, error


def _chat(url: str) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", **CHAT}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def cluster(
    target: Path, tiny_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    _require_roles("router", "prefill", "decode")
    workdir = tmp_path_factory.mktemp("cluster")
    toml = workdir / "cluster.toml"
    toml.write_text(f'[transfer]\ncodec = "{CODEC}"\n')
    cluster = LocalCluster(
        workdir,
        model=tiny_dir,
        prefill_count=2,
        decode_count=2,
        common_args=["--served-model-name", "tiny", "--distributed-config", str(toml)],
        router_args=["--prefill-balancer", BALANCER, "--decode-balancer", BALANCER],
        env=_plugin_env(target),
    )
    cluster.start(STARTUP_TIMEOUT_S)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def hybrid_reply(tiny_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same chat on one hybrid node: a lossless codec must not change a token."""
    node = start_node("hybrid", tmp_path_factory.mktemp("hybrid"),
                      ["--model", tiny_dir, "--served-model-name", "tiny"])  # fmt: skip
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        return _chat(node.url)
    finally:
        node.stop()


def test_cluster_serves_chat_through_plugin_balancer_and_codec(
    cluster: LocalCluster, hybrid_reply: dict
):
    replies = [_chat(cluster.router.url) for _ in range(4)]
    for reply in replies:
        assert reply["choices"][0]["message"] == hybrid_reply["choices"][0]["message"]
        assert reply["usage"] == hybrid_reply["usage"]
    stats = httpx.get(f"{cluster.router.url}/router/stats", timeout=10).json()
    assert set(stats["balancers"].values()) == {BALANCER}
    for role in ("prefill", "decode"):
        dispatched = sum(node["dispatched"] for node in stats["nodes"][role])
        assert dispatched == len(replies), (role, stats["nodes"][role])
