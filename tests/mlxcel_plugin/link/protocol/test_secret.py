import os
import stat

import pytest

from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.link.protocol.secret import (
    ClusterSecret,
    generate_secret_file,
    load_cluster_secret,
    parse_secret_text,
    require_cluster_secret,
)

HEX = "ab" * 32


def test_hex_text_decodes_and_whitespace_is_stripped():
    assert parse_secret_text(f"  {HEX}\n".encode()) == bytes.fromhex(HEX)


def test_non_hex_is_raw_bytes():
    assert parse_secret_text(b"not hex at all, just a passphrase") == (
        b"not hex at all, just a passphrase"
    )


def test_precedence_cli_file_over_env_file_over_env(tmp_path):
    cli, env_file = tmp_path / "cli", tmp_path / "env"
    cli.write_text("11" * 16)
    env_file.write_text("22" * 16)
    env = {"MLXCEL_CLUSTER_SECRET_FILE": str(env_file), "MLXCEL_CLUSTER_SECRET": "33" * 16}
    assert load_cluster_secret(str(cli), env).reveal() == b"\x11" * 16
    assert load_cluster_secret(None, env).reveal() == b"\x22" * 16
    assert load_cluster_secret(None, {"MLXCEL_CLUSTER_SECRET": "33" * 16}).reveal() == b"\x33" * 16
    assert load_cluster_secret(None, {}) is None


def test_short_secret_is_a_config_error():
    with pytest.raises(ConfigError, match="at least 16"):
        load_cluster_secret(None, {"MLXCEL_CLUSTER_SECRET": "aa" * 15})


def test_missing_file_names_the_path_not_the_content(tmp_path):
    with pytest.raises(ConfigError, match="nope"):
        load_cluster_secret(str(tmp_path / "nope"), {})


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_distributed_roles_refuse_without_a_secret(role):
    with pytest.raises(ConfigError, match="openssl rand -hex 32") as info:
        require_cluster_secret(role, None, {})
    assert "\n" not in str(info.value)


def test_hybrid_needs_no_secret():
    assert require_cluster_secret("hybrid", None, {}) is None


def test_secret_never_in_repr_or_str():
    raw = b"super-secret-value-1234"
    secret = ClusterSecret(raw)
    for text in (repr(secret), str(secret), f"{secret}", repr([secret])):
        assert "super" not in text and raw.hex() not in text


def test_generate_secret_file_is_0600_and_loads(tmp_path):
    path = generate_secret_file(tmp_path / "cluster.secret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(load_cluster_secret(str(path), {})) == 32
