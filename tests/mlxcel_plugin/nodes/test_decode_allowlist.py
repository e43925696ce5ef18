import pytest

from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.link.protocol.request_checks import (
    DecodeTargetMalformed,
    canonical_host_port,
)
from mlxcel_plugin.nodes.decode_allowlist import DecodeAllowlist


def test_unset_allows_any_well_formed_target():
    assert DecodeAllowlist.from_env({}).allows("10.0.0.1:9000")


def test_listed_targets_only():
    env = {"MLXCEL_DECODE_ALLOWLIST": "10.0.0.1:9000, 10.0.0.2:9000"}
    allowlist = DecodeAllowlist.from_env(env)
    assert allowlist.allows("10.0.0.2:9000")
    assert not allowlist.allows("evil.example:9000")


def test_entries_and_targets_compare_canonically():
    allowlist = DecodeAllowlist.parse(["Decode-1.Local:09000", "[0:0::1]:9000"])
    assert allowlist.targets == {"decode-1.local:9000", "[::1]:9000"}
    assert allowlist.allows("decode-1.LOCAL:9000")
    assert allowlist.allows("[::1]:9000")


@pytest.mark.parametrize("target", ["10.0.0.1:9000 ", " 10.0.0.1:9000", "10.0.0.1", "10.0.0.1:0",
                                    "10.0.0.1:99999", "::1:9000", "a b:9000", "ws://x:1",
                                    "10.0.0.1:9000/link", "", "h\u00e9:1"])
def test_a_malformed_target_is_never_allowed_and_named(target):
    for allowlist in (DecodeAllowlist(), DecodeAllowlist.parse(["10.0.0.1:9000"])):
        assert not allowlist.allows(target)
    with pytest.raises(DecodeTargetMalformed) as caught:
        canonical_host_port(target)
    assert caught.value.code == "decode_target_malformed"


def test_a_malformed_entry_stops_the_node_at_startup():
    with pytest.raises(ConfigError, match="MLXCEL_DECODE_ALLOWLIST"):
        DecodeAllowlist.from_env({"MLXCEL_DECODE_ALLOWLIST": "10.0.0.1:9000,decode-2"})
