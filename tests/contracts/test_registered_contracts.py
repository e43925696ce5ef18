"""Every codec and transfer strategy the core registers, and every installed balancer,
passes the shared contracts."""

from __future__ import annotations

import pytest

from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.testing.balancer_contract import CONTRACT_CHECKS
from mlxcel_plugin.testing.codec_contract import CodecContract
from mlxcel_plugin.testing.transfer_contract import TransferStrategyContract

REGISTRY = load_plugins(env={"MLXCEL_PLUGINS": "core"})
CODECS = REGISTRY.entries["kv_codec"]
# Chains are built by name from registered codecs; the useful ones get the contract too.
CODEC_NAMES = sorted({*REGISTRY.names("kv_codec"), "int8+lz4", "int4+shuffle+lz4"})


class TestRegisteredCodecs(CodecContract):
    @pytest.fixture(params=CODEC_NAMES)
    def codec(self, request):
        return resolve_codec(request.param, CODECS)


class TestRegisteredStrategies(TransferStrategyContract):
    @pytest.fixture(params=REGISTRY.names("transfer_strategy"))
    def factory(self, request):
        return REGISTRY.get("transfer_strategy", request.param)


# Balancers come from the router's plugin and any third-party one installed.
INSTALLED = load_plugins()


@pytest.mark.parametrize("name", INSTALLED.names("balancer"))
@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__)
def test_registered_balancers(name, check):
    check(INSTALLED.get("balancer", name))
