import pytest

from mlxcel_plugin.config import ServerConfig, build_config, parse_host_port, split_addresses
from mlxcel_plugin.errors import ConfigError
from tests.conftest import REPO


def write_toml(tmp_path, text):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_any_source():
    config = build_config({}, env={})
    assert config == ServerConfig(engine_config=config.engine_config)
    assert (config.role, config.host, config.port) == ("hybrid", "127.0.0.1", 8080)
    assert config.engine_config.max_batch_size == 32


def test_cli_beats_toml_beats_env(tmp_path):
    toml = write_toml(tmp_path, '[server]\nport = 9001\nhost = "127.0.0.2"\n')
    env = {"MLXCEL_PORT": "9000", "MLXCEL_HOST": "127.0.0.3", "MLXCEL_NODE_ID": "n1"}
    config = build_config({"distributed_config": toml, "port": 9002}, env=env)
    assert config.port == 9002
    assert config.host == "127.0.0.2"
    assert config.node_id == "n1"


def test_peer_lists_from_env_and_toml(tmp_path):
    toml = write_toml(tmp_path, '[server]\ndecode_peers = ["127.0.0.1:7001", "127.0.0.1:7002"]\n')
    config = build_config(
        {"distributed_config": toml, "role": "router"},
        env={"MLXCEL_PREFILL_PEERS": "127.0.0.1:6001, 127.0.0.1:6002"},
    )
    assert config.prefill_peers == ("127.0.0.1:6001", "127.0.0.1:6002")
    assert config.decode_peers == ("127.0.0.1:7001", "127.0.0.1:7002")


def test_engine_section_and_no_warmup(tmp_path):
    toml = write_toml(tmp_path, "[engine]\nmax_batch_size = 8\nwarmup = true\n")
    config = build_config({"distributed_config": toml, "warmup": False}, env={})
    assert config.engine_config.max_batch_size == 8
    assert config.engine_config.warmup is False


def test_other_sections_are_kept_raw(tmp_path):
    toml = write_toml(tmp_path, '[transfer]\nstrategy = "streamed"\n')
    config = build_config({"distributed_config": toml}, env={})
    assert config.section("transfer") == {"strategy": "streamed"}
    assert config.section("missing") == {}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"role": "oracle"}, "--node-role must be one of"),
        ({"port": 70000}, "--port must be 1..65535"),
        ({"role": "prefill"}, "needs --serving-bind"),
        (
            {"role": "router", "prefill_peers": "127.0.0.1:1"},
            "needs --prefill-peers and --decode-peers",
        ),
        ({"serving_bind": "nohost"}, "is not host:port"),
        ({"model": "/definitely/not/here"}, "not a checkpoint directory"),
    ],
)
def test_invalid_values_are_one_line_config_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(values, env={})


def test_unknown_toml_keys_are_named(tmp_path):
    toml = write_toml(tmp_path, "[server]\nprot = 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        build_config({"distributed_config": toml}, env={})
    toml = write_toml(tmp_path, "[engine]\nmax_batch = 1\n")
    with pytest.raises(ConfigError, match=r"\[engine\]: unknown key\(s\) max_batch"):
        build_config({"distributed_config": toml}, env={})


def test_bad_toml_and_bad_types(tmp_path):
    with pytest.raises(ConfigError, match="invalid TOML"):
        build_config({"distributed_config": write_toml(tmp_path, "[server\n")}, env={})
    with pytest.raises(ConfigError, match="invalid value"):
        build_config({}, env={"MLXCEL_PORT": "eighty"})
    with pytest.raises(ConfigError, match="no such file"):
        build_config({"distributed_config": str(tmp_path / "none.toml")}, env={})


def test_address_parsing():
    assert parse_host_port("[::1]:80") == ("::1", 80)
    assert split_addresses(" a:1 ,, b:2 ") == ("a:1", "b:2")
    with pytest.raises(ConfigError):
        parse_host_port("a:0")


def test_node_id_defaults_from_role_and_bind():
    config = build_config({"role": "decode", "serving_bind": "127.0.0.1:7000"}, env={})
    assert config.effective_node_id == "decode@127.0.0.1:7000"


def test_prefix_cache_default_is_on_and_bounded():
    prefix = build_config({}, env={}).engine_config.prefix_cache
    assert prefix.max_bytes == 1024**3 and prefix.reuse_generated is False


def test_prefix_cache_flag_beats_toml_beats_env(tmp_path):
    toml = write_toml(tmp_path, "[prefix_cache]\nmax_bytes = 2000\nreuse_generated = true\n")
    env = {"MLXCEL_PREFIX_CACHE_BYTES": "1000"}
    assert build_config({}, env=env).engine_config.prefix_cache.max_bytes == 1000
    from_toml = build_config({"distributed_config": toml}, env=env).engine_config.prefix_cache
    assert (from_toml.max_bytes, from_toml.reuse_generated) == (2000, True)
    flagged = build_config({"distributed_config": toml, "prefix_cache_bytes": 0}, env=env)
    assert flagged.engine_config.prefix_cache.max_bytes == 0
    assert "prefix_cache" not in flagged.sections


def test_prefix_cache_rejects_bad_values(tmp_path):
    with pytest.raises(ConfigError, match="must be >= 0"):
        build_config({"prefix_cache_bytes": -1}, env={})
    with pytest.raises(ConfigError, match=r"\[prefix_cache\]: unknown key"):
        build_config({"distributed_config": write_toml(tmp_path, "[prefix_cache]\nsize = 1\n")})
    with pytest.raises(ConfigError, match="max_bytes"):
        build_config({}, env={"MLXCEL_PREFIX_CACHE_BYTES": "lots"})
    with pytest.raises(ConfigError, match="granularity must be one of auto, chunk"):
        build_config({"distributed_config": write_toml(tmp_path, "[prefix_cache]\n"
                                                                 "granularity = 'token'\n")})


def test_the_shipped_prefix_cache_example_loads_as_documented():
    config = build_config({"distributed_config": str(REPO / "examples" / "prefix-cache.toml")},
                          env={})
    prefix = config.engine_config.prefix_cache
    assert (prefix.max_bytes, prefix.reuse_generated, prefix.local_prefill_tokens,
            prefix.granularity) == (1024**3, False, 256, "auto")
    assert (config.prefill_balancer, config.decode_balancer) == ("prefix-aware", "prefix-aware")
    assert config.section("router") == {"prefix_block_tokens": 128}


def test_speculative_section(tmp_path):
    assert build_config({}, env={}).engine_config.speculative.method == "off"  # off by default
    toml = write_toml(tmp_path, '[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 6\n')
    spec = build_config({"distributed_config": toml}, env={}).engine_config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_max) == ("ngram", 6, 4)
    for text, named in [('method = "eagle"', "method"),
                        ('method = "draft"', "draft_model"), ("ngram_min = 5", "ngram_min"),
                        ("num_speculative_tokens = 0", "num_speculative_tokens"),
                        ("lookahead = 3", "lookahead")]:
        toml = write_toml(tmp_path, f"[speculative]\n{text}\n")
        with pytest.raises(ConfigError, match=named):
            build_config({"distributed_config": toml}, env={})
