"""The pre-shared cluster secret: where it comes from, and how it stays out of logs.

Precedence: ``--cluster-secret-file`` > ``MLXCEL_CLUSTER_SECRET_FILE`` >
``MLXCEL_CLUSTER_SECRET``. Hex text (what ``openssl rand -hex 32`` writes)
decodes to bytes; anything else is used as raw bytes.
"""

from __future__ import annotations

import binascii
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

from mlxcel_plugin.errors import ConfigError

MIN_SECRET_BYTES = 16
ENV_SECRET_FILE = "MLXCEL_CLUSTER_SECRET_FILE"
ENV_SECRET = "MLXCEL_CLUSTER_SECRET"
ROLES_NEEDING_SECRET = frozenset({"prefill", "decode", "router"})
HOW_TO_MAKE_ONE = (
    "make one with `openssl rand -hex 32 > cluster.secret` and pass "
    "--cluster-secret-file cluster.secret (or set MLXCEL_CLUSTER_SECRET_FILE)"
)
_HEX_TEXT = re.compile(rb"(?:[0-9a-fA-F]{2})+")


class ClusterSecret:
    """Secret bytes that never show up in a repr, str or traceback."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes):
        if len(value) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"cluster secret is {len(value)} bytes, needs at least {MIN_SECRET_BYTES}; "
                + HOW_TO_MAKE_ONE
            )
        self._value = bytes(value)

    def reveal(self) -> bytes:
        """The raw bytes; only the key schedule should call this."""
        return self._value

    def __len__(self) -> int:
        return len(self._value)

    def __repr__(self) -> str:
        return "ClusterSecret(<redacted>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSecret):
            return NotImplemented
        return secrets.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        # Hashing the secret would leak bits through dict timing; identity is enough.
        return id(self)

    def __reduce__(self):
        # Pickling (multiprocessing, logging handlers) must not copy the secret around.
        raise TypeError("ClusterSecret cannot be pickled")


def parse_secret_text(raw: bytes) -> bytes:
    """Hex text decodes to bytes (whitespace stripped); anything else is raw bytes."""
    stripped = b"".join(raw.split())
    if _HEX_TEXT.fullmatch(stripped):
        return binascii.unhexlify(stripped)
    return raw


def _read_secret_file(path: str, source: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        # Name the file, never its content.
        raise ConfigError(
            f"cannot read cluster secret file from {source}: {path} ({exc.strerror})"
        ) from None


def load_cluster_secret(cli_path: str | None, env: Mapping[str, str]) -> ClusterSecret | None:
    """The cluster secret from the CLI flag or the environment, or None when none is set."""
    if cli_path:
        raw = _read_secret_file(cli_path, "--cluster-secret-file")
    elif env.get(ENV_SECRET_FILE):
        raw = _read_secret_file(env[ENV_SECRET_FILE], ENV_SECRET_FILE)
    elif env.get(ENV_SECRET):
        raw = env[ENV_SECRET].encode()
    else:
        return None
    return ClusterSecret(parse_secret_text(raw))


def require_cluster_secret(
    role: str, cli_path: str | None, env: Mapping[str, str]
) -> ClusterSecret | None:
    """Load the secret; prefill, decode and router refuse to start without one."""
    secret = load_cluster_secret(cli_path, env)
    if secret is None and role in ROLES_NEEDING_SECRET:
        raise ConfigError(f"--node-role {role} needs a cluster secret: " + HOW_TO_MAKE_ONE)
    return secret


def generate_secret_file(path: str | os.PathLike[str], n_bytes: int = 32) -> Path:
    """Write a fresh hex secret readable only by its owner (0600)."""
    target = Path(path)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(n_bytes) + "\n")
    os.chmod(target, 0o600)  # umask could only have narrowed it, but be explicit
    return target
