"""``mlxcel-server``: parse flags, build the config, load plugins, run a role.

Every role comes from a plugin (``mlxcel_register_roles``), so this module
imports neither ``engines`` nor ``router_plugin``.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxcel_plugin import openblas
from mlxcel_plugin.config import ROLES, ServerConfig, build_config
from mlxcel_plugin.errors import ConfigError, MlxcelError
from mlxcel_plugin.link import require_cluster_secret
from mlxcel_plugin.model_cache import DEFAULT_MODEL_DIRNAME, cache_dir
from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.shard_ranks import prepare_ranks

PROG = "mlxcel-server"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Disaggregated MLX inference: hybrid, prefill, decode or router node.",
        argument_default=argparse.SUPPRESS,  # only flags actually given override TOML/env
    )
    add = parser.add_argument
    add_model_flags(parser)
    add("--served-model-name", help="model name served at /v1/models (default: dir name)")
    add("--host", help="HTTP bind host (default 127.0.0.1)")
    add("--port", type=int, help="HTTP port (default 8080)")
    add("--node-role", dest="role", choices=ROLES, help="serving role (default hybrid)")
    add("--engine", help="engine plugin name (default mlx)")
    add("--serving-bind", help="this node's link listener HOST:PORT")
    add("--prefill-peers", help="comma-separated prefill node link addresses")
    add("--decode-peers", help="comma-separated decode node link addresses")
    add("--peers", help="comma-separated static peer addresses for discovery")
    add("--peers-file", help="router: TOML peers file (prefill/decode lists), re-read on change")
    add("--discovery", help="router: extra discovery sources, comma-separated (mdns, kubernetes)")
    add("--advertise", choices=("mdns",), help="node: announce itself on the LAN (mdns)")
    add("--node-id", help="unique node id (default: role@bind)")
    add("--cluster-secret-file", help="pre-shared cluster secret file")
    add("--distributed-config", help="TOML cluster configuration file")
    add("--prefill-balancer", help="prefill pool balancer (a registered name)")
    add("--decode-balancer", help="decode pool balancer (a registered name)")
    add("--prefix-cache-bytes", type=int,
        help="prompt KV kept across requests, in bytes (default 1 GiB; 0 disables)")
    add_kv_plane_flags(parser)
    add("--adapter", dest="adapters", action="append",
        help="serve the LoRA adapter at PATH (mlx-lm format) as model NAME: "
             "NAME=PATH[@BASE] (repeatable)")
    add("--enable-lora", action="store_true",
        help="allow loading LoRA adapters at run time (POST /v1/load_lora_adapter; "
             "implied by --adapter)")
    add("--no-warmup", dest="warmup", action="store_false", help="skip the warmup pass")
    add("--api-key", dest="api_keys", action="append",
        help="hybrid/router: require Authorization: Bearer KEY on /v1/* (repeatable)")
    add("--metrics-require-key", action="store_true", help="also on /health* and /metrics")
    add("--max-request-bytes", type=int, help="largest request body (default 8 MiB)")
    add("--ssl-keyfile", help="hybrid/router: serve HTTPS with this key (and --ssl-certfile)")
    add("--ssl-certfile", help="hybrid/router: serve HTTPS with this certificate")
    add("--shard-ranks", type=int,
        help="engine roles: split the model over N local tensor-parallel ranks (mlx ring)")
    add("--shard-hostfile", help="engine roles: mlx ring hostfile (JSON) of ranks on several hosts")
    add("--shard-rank", type=int, help="this process's rank in --shard-hostfile (0 serves)")
    add("--log-level", choices=("debug", "info", "warning", "error"), help="log level")
    return parser


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """``--model``; a hybrid node serving several: their bounds (docs/models-and-adapters.md)."""
    add = parser.add_argument
    add("--model", action="append",
        help="mlx-lm checkpoint dir (default: embedded SmolLM2-135M-Instruct); hybrid: "
             "NAME=PATH, repeatable, serves several models (docs/models-and-adapters.md)")
    add("--max-loaded-models", type=int,
        help="hybrid, several models: at most N loaded at once (default 0: memory decides)")
    add("--model-memory-bytes", type=int,
        help="hybrid, several models: weights loaded at once, in bytes (default 0: half "
             "the machine's memory)")
    add("--model-wait-s", type=float,
        help="hybrid, several models: how long a request waits for a busy model to go idle "
             "before a 503 (default 30)")
    add("--load-on-start", action="store_true",
        help="hybrid, several models: load them at start (as many as fit), not on first use")


def add_kv_plane_flags(parser: argparse.ArgumentParser) -> None:
    """How KV handoffs travel and land (docs/bulk-lanes.md: lanes, receive pool)."""
    add = parser.add_argument
    add("--receive-pool-bytes", type=int,
        help="decode node: freed KV receive buffers kept faulted in for the next handoffs, "
             "in bytes ([engine] receive_pool_bytes; default auto, at most 2 GiB)")
    add("--bulk-lanes", type=int,
        help="parallel encrypted TCP lanes per KV link, 1-16 (default: one per core, up to 4)")
    add("--ingest-nice", type=int,
        help="decode node: CPU niceness 0-19 of the threads receiving KV handoffs, so a busy "
             "core runs the streams' steps first (default 15; 0: ingest at full priority)")


def resolve_default_model() -> str:
    """The embedded model's MLX checkpoint, converted once by the engines package.

    Conversion needs MLX, so it runs in a child process: the router (and this
    module) never import MLX.
    """
    target = cache_dir() / DEFAULT_MODEL_DIRNAME
    if (target / "config.json").is_file():
        return str(target)
    done = subprocess.run(
        [sys.executable, "-m", "engines.model_store", "smollm2"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"could not prepare the default model: {tail[0]}")
    return done.stdout.strip().splitlines()[-1]


def resolve_model(config: ServerConfig) -> ServerConfig:
    model = config.model or resolve_default_model()
    name = config.served_model_name or Path(model).name
    return replace(config, model=model, served_model_name=name)


def maybe_reexec_with_openblas(config: ServerConfig, argv: Sequence[str]) -> None:
    """Engine roles run MLX on the CPU; re-exec once with OpenBLAS preloaded."""
    if config.role == "router":
        return
    env = openblas.preload_env(os.environ)
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", "mlxcel_plugin.cli", *argv], env)


def run(argv: Sequence[str]) -> None:
    args: dict[str, Any] = vars(make_parser().parse_args(argv))
    config = build_config(args)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Fail fast, before any model is loaded or converted (a follower rank serves no link).
    if config.shard_rank == 0:
        require_cluster_secret(config.role, config.cluster_secret_file, os.environ)
    maybe_reexec_with_openblas(config, argv)
    if config.role != "router":
        openblas.limit_numpy_blas()  # the codecs' NumPy BLAS: one thread, no spinning
    config = resolve_model(config)
    prepare_ranks(config)  # --shard-ranks / --shard-hostfile (mlxcel_plugin/shard_ranks.py)
    registry = load_plugins()
    run_role = registry.get("role", config.role)
    run_role(config, registry)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        run(argv)
    except MlxcelError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
