"""Configuration: frozen dataclasses with one source of defaults.

Precedence: CLI flags > TOML file (``--distributed-config``) > env vars > defaults.
Each TOML section maps onto one dataclass; an unknown key is a startup error.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_type_hints

from mlxcel_plugin.adapter_specs import parse_adapter_spec
from mlxcel_plugin.engine_api import EngineConfig, PrefixCacheConfig
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.model_specs import ModelSpec, parse_model_specs, specs_from_toml
from mlxcel_plugin.speculative.settings import METHODS, SpeculativeConfig

ROLES = ("hybrid", "prefill", "decode", "router")
# link.protocol.handshake's bound (the link imports this module's package: not imported here).
MAX_BULK_LANES = 16
MAX_NICE = 19  # the lowest CPU priority Linux gives a thread
DEFAULT_INGEST_NICE = 15  # a decode node's KV readers (docs/bulk-lanes.md#ingest-priority)
# 8 MiB: a 128k-token prompt of ordinary text with room for tool schemas.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    role: str = "hybrid"
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    engine: str = "mlx"
    serving_bind: str | None = None
    prefill_peers: tuple[str, ...] = ()
    decode_peers: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    peers_file: str | None = None  # TOML with prefill/decode lists, re-read when it changes
    discovery: str = ""  # extra discovery sources, comma-separated (e.g. "mdns")
    advertise: str = ""  # "mdns": a node announces itself on the LAN
    node_id: str | None = None
    cluster_secret_file: str | None = None
    distributed_config: str | None = None
    warmup: bool = True
    prefill_balancer: str = "prefix-aware"
    decode_balancer: str = "prefix-aware"
    log_level: str = "info"
    # The HTTP front of hybrid and router (router_plugin/http/options.py).
    # --api-key, repeatable; empty: no key asked. Kept out of repr (logs, tracebacks).
    api_keys: frozenset[str] = field(default=frozenset(), repr=False)
    metrics_require_key: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # Tensor-parallel ranks of one engine role (engines/sharding/engine.py): N local ranks,
    # or a ring hostfile (mlx's JSON, one ["ip:port"] per rank) and this process's rank.
    shard_ranks: int = 1
    shard_hostfile: str | None = None
    shard_rank: int = 0
    # Several models on a hybrid node (docs/models-and-adapters.md): "NAME=PATH" each, from
    # a repeated --model or [models.NAME] tables; empty: the one ``model``.
    models: tuple[str, ...] = ()
    max_loaded_models: int = 0  # 0: as many as the memory budget allows
    model_memory_bytes: int = 0  # weights of the loaded models together; 0: half the machine's
    model_wait_s: float = 30.0  # a request for an unloaded model waits this long for an idle one
    load_on_start: bool = False  # False: each model loads on its first request
    # Bulk lanes a prefill node asks of decode nodes, and the most a node grants (--bulk-lanes,
    # MLXCEL_BULK_LANES; docs/bulk-lanes.md); 0: one per core, up to 4.
    bulk_lanes: int = 0
    # Decode node: CPU niceness of the threads that receive KV handoffs (--ingest-nice; Linux),
    # so a saturated core runs the streams' steps first (docs/bulk-lanes.md#ingest-priority).
    ingest_nice: int = DEFAULT_INGEST_NICE
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    # Raw TOML sections for sub-configs owned by other modules (scheduler, transfer, ...).
    sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def effective_node_id(self) -> str:
        if self.node_id:
            return self.node_id
        where = self.serving_bind or f"{self.host}:{self.port}"
        return f"{self.role}@{where}"

    def section(self, name: str) -> Mapping[str, Any]:
        return self.sections.get(name, {})


# env var -> ServerConfig field (only where an env var is sensible)
ENV_VARS = {
    "MLXCEL_NODE_ROLE": "role",
    "MLXCEL_MODEL": "model",
    "MLXCEL_SERVED_MODEL_NAME": "served_model_name",
    "MLXCEL_HOST": "host",
    "MLXCEL_PORT": "port",
    "MLXCEL_SERVING_BIND": "serving_bind",
    "MLXCEL_PREFILL_PEERS": "prefill_peers",
    "MLXCEL_DECODE_PEERS": "decode_peers",
    "MLXCEL_PEERS": "peers",
    "MLXCEL_PEERS_FILE": "peers_file",
    "MLXCEL_DISCOVERY": "discovery",
    "MLXCEL_ADVERTISE": "advertise",
    "MLXCEL_NODE_ID": "node_id",
    "MLXCEL_DISTRIBUTED_CONFIG": "distributed_config",
    "MLXCEL_API_KEY": "api_keys",  # comma-separated
    "MLXCEL_MAX_REQUEST_BYTES": "max_request_bytes",
    "MLXCEL_BULK_LANES": "bulk_lanes",
    "MLXCEL_INGEST_NICE": "ingest_nice",
    "MLX_HOSTFILE": "shard_hostfile",  # as mlx.launch sets them
    "MLX_RANK": "shard_rank",
}

# TOML sections handled here; other sections are kept raw in ``sections``.
SERVER_SECTION = "server"
ENGINE_SECTION = "engine"
PREFIX_CACHE_SECTION = "prefix_cache"
PREFIX_CACHE_BYTES_ENV = "MLXCEL_PREFIX_CACHE_BYTES"
PREFIX_CACHE_BYTES_FLAG = "prefix_cache_bytes"  # --prefix-cache-bytes
RECEIVE_POOL_BYTES_FLAG = "receive_pool_bytes"  # --receive-pool-bytes: [engine]'s key
ADAPTERS_FLAG = "adapters"  # --adapter, repeatable
MODEL_FLAG = "model"  # --model PATH or NAME=PATH, repeatable
ENABLE_LORA_FLAG = "enable_lora"  # --enable-lora
SPECULATIVE_SECTION = "speculative"


def split_addresses(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"a:1, b:2"`` or ``["a:1", "b:2"]`` -> ``("a:1", "b:2")``, each checked as host:port."""
    items = value.split(",") if isinstance(value, str) else list(value)
    addresses = tuple(item.strip() for item in items if item.strip())
    for address in addresses:
        parse_host_port(address)
    return addresses


def parse_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Turn env/TOML/CLI values into the field's type, with a clear error."""
    text = str(hint)
    try:
        if text.startswith("frozenset"):  # secrets, not addresses: "a,b" or a list
            items = value.split(",") if isinstance(value, str) else list(value)
            return frozenset(str(item).strip() for item in items if str(item).strip())
        if "tuple" in text:
            return split_addresses(value)
        if text in ("bool", "<class 'bool'>"):
            if isinstance(value, bool):
                return value
            lowered = str(value).strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if text.startswith("int") or text == "<class 'int'>":
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if text.startswith("float") or text == "<class 'float'>":
            return float(value)
        if "str" in text:
            return None if value is None else str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: invalid value {value!r}") from exc
    return value


def dataclass_from_mapping(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """Build ``cls`` from a mapping, rejecting unknown keys and coercing types."""
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        known_list = ", ".join(sorted(known))
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {known_list}")
    return cls(**{k: _coerce(f"{where}.{k}", hints[k], v) for k, v in data.items()})


def _apply(config: ServerConfig, values: Mapping[str, Any], where: str) -> ServerConfig:
    hints = get_type_hints(ServerConfig)
    coerced = {k: _coerce(f"{where}.{k}", hints[k], v) for k, v in values.items()}
    return replace(config, **coerced)


def _env_values(env: Mapping[str, str]) -> dict[str, Any]:
    return {fld: env[var] for var, fld in ENV_VARS.items() if env.get(var)}


def read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigError(f"--distributed-config: no such file {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--distributed-config {path}: invalid TOML: {exc}") from exc


def _toml_values(document: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict]:
    server = dict(document.get(SERVER_SECTION, {}))
    server_fields = {f.name for f in fields(ServerConfig)} - {"engine_config", "sections",
                                                               "models"}  # [models.NAME]
    unknown = sorted(set(server) - server_fields)
    if unknown:
        raise ConfigError(f"[server]: unknown key(s) {', '.join(unknown)}")
    engine = dict(document.get(ENGINE_SECTION, {}))
    other = {k: v for k, v in document.items() if k not in (SERVER_SECTION, ENGINE_SECTION)}
    return server, engine, other


def build_config(
    cli_values: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> ServerConfig:
    """Merge defaults < env < TOML < CLI (``cli_values`` holds only flags actually given)."""
    env = os.environ if env is None else env
    cli_values = dict(cli_values)
    prefix_cache_bytes = cli_values.pop(PREFIX_CACHE_BYTES_FLAG, None)
    adapters = tuple(cli_values.pop(ADAPTERS_FLAG, ()))
    enable_lora = cli_values.pop(ENABLE_LORA_FLAG, False)
    model_texts = cli_values.pop(MODEL_FLAG, None)
    receive_pool_bytes = cli_values.pop(RECEIVE_POOL_BYTES_FLAG, None)
    config = _apply(ServerConfig(), _env_values(env), "env")
    toml_path = cli_values.get("distributed_config") or config.distributed_config
    engine_values: dict[str, Any] = {}
    prefix_toml: Mapping[str, Any] = {}
    speculative_toml: Mapping[str, Any] = {}
    if toml_path:
        server, engine_values, other = _toml_values(read_toml(toml_path))
        config = _apply(config, server, "[server]")
        prefix_toml = other.pop(PREFIX_CACHE_SECTION, {})
        speculative_toml = other.pop(SPECULATIVE_SECTION, {})
        config = replace(config, sections=other)
    config = with_models(_apply(config, cli_values, "flag"), model_texts)
    # --no-warmup beats [engine] warmup; otherwise [engine] beats [server]/env.
    if "warmup" in cli_values:
        engine_values["warmup"] = config.warmup
    engine_values.setdefault("warmup", config.warmup)
    if receive_pool_bytes is not None:
        engine_values[RECEIVE_POOL_BYTES_FLAG] = receive_pool_bytes
    # "NAME=PATH" strings, not addresses: kept out of the generic tuple coercion.
    adapters = adapters or tuple(str(a) for a in engine_values.pop(ADAPTERS_FLAG, ()))
    engine_config = dataclass_from_mapping(EngineConfig, engine_values, "[engine]")
    prefix_cache = prefix_cache_config(env, prefix_toml, prefix_cache_bytes)
    engine_config = replace(engine_config, prefix_cache=prefix_cache,
                            speculative=speculative_config(speculative_toml))
    for spec in adapters:
        parse_adapter_spec(spec)  # a bad one fails at start, before any model loads
    engine_config = replace(engine_config, adapters=adapters,
                            enable_lora=bool(enable_lora or adapters or engine_config.enable_lora))
    config = replace(config, engine_config=engine_config, warmup=engine_config.warmup)
    return validate(config)


def with_models(config: ServerConfig, texts: str | list[str] | None) -> ServerConfig:
    """``--model`` values (else a node's ``[models.NAME]`` tables) into ``model``/``models``.

    One plain PATH is today's single model; ``NAME=PATH`` names it; several make ``models``
    (the first is the default model: ``model`` and ``served_model_name``).
    """
    texts = [texts] if isinstance(texts, str) else texts
    if texts:
        specs = parse_model_specs(texts)
    elif config.role == "hybrid" and config.section("models"):
        specs = specs_from_toml(config.section("models"))
    else:
        return config
    if isinstance(specs[0], str):
        return replace(config, model=specs[0])
    first = specs[0]
    if config.served_model_name not in (None, first.name):
        raise ConfigError(f"--served-model-name {config.served_model_name!r} and --model "
                          f"{first.as_flag()!r} name the model twice")  # fmt: skip
    named = tuple(spec.as_flag() for spec in specs if isinstance(spec, ModelSpec))
    return replace(config, model=first.path, served_model_name=first.name,
                   models=named if len(named) > 1 else ())


PREFIX_GRANULARITIES = ("auto", "chunk")


def prefix_cache_config(
    env: Mapping[str, str], section: Mapping[str, Any], flag_bytes: int | None
) -> PrefixCacheConfig:
    """``--prefix-cache-bytes`` > ``[prefix_cache]`` > ``MLXCEL_PREFIX_CACHE_BYTES`` > default."""
    values: dict[str, Any] = {}
    if env.get(PREFIX_CACHE_BYTES_ENV):
        values["max_bytes"] = env[PREFIX_CACHE_BYTES_ENV]
    values.update(section)
    if flag_bytes is not None:
        values["max_bytes"] = flag_bytes
    config = dataclass_from_mapping(PrefixCacheConfig, values, "[prefix_cache]")
    if config.max_bytes < 0:
        raise ConfigError(f"prefix cache max_bytes must be >= 0 (0: off), got {config.max_bytes}")
    if config.granularity not in PREFIX_GRANULARITIES:
        raise ConfigError(f"[prefix_cache] granularity must be one of "
                          f"{', '.join(PREFIX_GRANULARITIES)}, got {config.granularity!r}")
    return config


def speculative_config(section: Mapping[str, Any]) -> SpeculativeConfig:
    """``[speculative]`` (docs/speculative.md), checked."""
    config = dataclass_from_mapping(SpeculativeConfig, section, "[speculative]")
    if config.method not in METHODS:
        raise ConfigError(f"[speculative] method must be one of {', '.join(METHODS)}, "
                          f"got {config.method!r}")
    if not 1 <= config.num_speculative_tokens <= 16:
        raise ConfigError("[speculative] num_speculative_tokens must be 1..16, "
                          f"got {config.num_speculative_tokens}")
    if not 1 <= config.ngram_min <= config.ngram_max <= 16:
        raise ConfigError("[speculative] needs 1 <= ngram_min <= ngram_max <= 16, got "
                          f"{config.ngram_min}, {config.ngram_max}")
    if config.method == "draft" and not config.draft_model:
        raise ConfigError('[speculative] method = "draft" needs draft_model = PATH')
    if config.verify_row_cost < 0:
        raise ConfigError(f"[speculative] verify_row_cost must be >= 0, got "
                          f"{config.verify_row_cost}")
    return config


def validate(config: ServerConfig) -> ServerConfig:
    if config.role not in ROLES:
        raise ConfigError(f"--node-role must be one of {', '.join(ROLES)}, got {config.role!r}")
    if not 0 < config.port < 65536:
        raise ConfigError(f"--port must be 1..65535, got {config.port}")
    if config.serving_bind:
        parse_host_port(config.serving_bind)
    if config.role in ("prefill", "decode") and not config.serving_bind:
        raise ConfigError(f"--node-role {config.role} needs --serving-bind HOST:PORT")
    has_pools = config.prefill_peers and config.decode_peers
    dynamic = config.peers_file or config.discovery
    model_pools = config.section("models")  # [models.NAME]: router_plugin/cluster/model_pools
    if config.role == "router" and not (config.peers or has_pools or dynamic or model_pools):
        raise ConfigError("--node-role router needs --prefill-peers and --decode-peers, --peers,"
                          " --peers-file, --discovery or [models.NAME] sections")
    if bool(config.ssl_keyfile) != bool(config.ssl_certfile):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
    for tls_file in (config.ssl_keyfile, config.ssl_certfile):
        if tls_file and not Path(tls_file).is_file():
            raise ConfigError(f"no such file: {tls_file}")
    _validate_shards(config)
    _validate_models(config)
    if not 0 <= config.bulk_lanes <= MAX_BULK_LANES:
        raise ConfigError(f"bulk_lanes = {config.bulk_lanes}: expected 1..{MAX_BULK_LANES} "
                          "lanes (0: one per core, up to 4)")
    if not 0 <= config.ingest_nice <= MAX_NICE:
        raise ConfigError(f"ingest_nice = {config.ingest_nice}: expected 0..{MAX_NICE}")
    if config.engine_config.receive_pool_bytes < 0:
        raise ConfigError("[engine] receive_pool_bytes must be >= 0 (0: auto)")
    if config.model is not None and not Path(config.model).is_dir():
        raise ConfigError(f"--model {config.model}: not a checkpoint directory")
    return config


def _validate_shards(config: ServerConfig) -> None:
    sharded = config.shard_ranks > 1 or config.shard_hostfile
    if config.shard_ranks < 1:
        raise ConfigError(f"--shard-ranks must be >= 1, got {config.shard_ranks}")
    if config.shard_ranks > 1 and config.shard_hostfile:
        raise ConfigError("--shard-ranks (local ranks) and --shard-hostfile go apart")
    if sharded and config.role == "router":
        raise ConfigError("a router holds no model: --shard-* is for engine roles")
    if config.shard_hostfile and not Path(config.shard_hostfile).is_file():
        raise ConfigError(f"--shard-hostfile: no such file {config.shard_hostfile}")
    if config.shard_rank < 0 or (config.shard_rank and not config.shard_hostfile):
        raise ConfigError("--shard-rank R needs --shard-hostfile and R >= 0")


def _validate_models(config: ServerConfig) -> None:
    if config.models and config.role != "hybrid":
        raise ConfigError(f"--node-role {config.role} serves one model: give --model once "
                          "(several models: a hybrid node; docs/models-and-adapters.md)")
    if config.models and (config.engine_config.adapters or config.engine_config.enable_lora):
        raise ConfigError("--adapter / --enable-lora serve one model's adapters: not with "
                          "several --model yet")  # fmt: skip
    if config.models and (config.shard_ranks > 1 or config.shard_hostfile):
        raise ConfigError("--shard-* splits one model: not with several --model")
    for flag, value in (("--max-loaded-models", config.max_loaded_models),
                        ("--model-memory-bytes", config.model_memory_bytes),
                        ("--model-wait-s", config.model_wait_s)):  # fmt: skip
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
