"""Every registered serving role passes the shared role contract; the CLI's roles all exist."""

from __future__ import annotations

import pytest

from mlxcel_plugin.config import ROLES
from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.testing.role_contract import RoleContract, check_role_name, check_role_runner

# Every installed plugin, as `mlxcel-server` would load them (third-party roles included).
REGISTRY = load_plugins()


class TestRegisteredRoles(RoleContract):
    @pytest.fixture(params=REGISTRY.names("role"))
    def role(self, request):
        return request.param, REGISTRY.get("role", request.param)


def test_every_cli_role_is_registered():
    assert set(ROLES) <= set(REGISTRY.names("role"))


# --- the contract's own checks catch what they should ---------------------------------


def _run(config, registry):
    return None


async def _async_run(config, registry):
    return None


def _generator_run(config, registry):
    yield


@pytest.mark.parametrize("name", ["Hybrid", "", "1st", "my role", None])
def test_check_role_name_refuses(name):
    with pytest.raises(AssertionError):
        check_role_name(name)


def test_check_role_accepts_the_documented_shape():
    check_role_name("my-role_2")
    check_role_runner(_run)
    check_role_runner(lambda config, registry, *, verbose=False: None)


@pytest.mark.parametrize(
    "run",
    [_async_run, _generator_run, lambda config: None, lambda: None, "run_hybrid", None],
    ids=["coroutine", "generator", "one-arg", "no-arg", "not-callable", "none"],
)
def test_check_role_runner_refuses(run):
    with pytest.raises(AssertionError):
        check_role_runner(run)
