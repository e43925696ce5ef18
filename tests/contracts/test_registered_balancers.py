"""Every registered balancer passes the shared balancer contract."""

from __future__ import annotations

import pytest

from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.testing.balancer_contract import CONTRACT_CHECKS

# Every installed plugin, as `mlxcel-server` would load them (third-party balancers included).
REGISTRY = load_plugins()


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__)
@pytest.mark.parametrize("name", REGISTRY.names("balancer"))
def test_registered_balancer_honours_the_contract(name, check):
    check(REGISTRY.get("balancer", name))
