from mlxcel_plugin.nodes.decode_allowlist import DecodeAllowlist


def test_unset_allows_any_target():
    assert DecodeAllowlist.from_env({}).allows("10.0.0.1:9000")


def test_listed_targets_only():
    env = {"MLXCEL_DECODE_ALLOWLIST": "10.0.0.1:9000, 10.0.0.2:9000"}
    allowlist = DecodeAllowlist.from_env(env)
    assert allowlist.allows("10.0.0.2:9000")
    assert allowlist.allows(" 10.0.0.1:9000 ")
    assert not allowlist.allows("evil.example:9000")
