"""Link handshake messages: HELLO / FINISHED / VERDICT bytes and the key schedule (pure).

The state machines that use them are in ``handshake``; byte layouts are in
docs/protocol.md §2.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxcel_plugin.errors import ConfigError, HandshakeError
from mlxcel_plugin.link.protocol.secret import HOW_TO_MAKE_ONE, ClusterSecret

MAGIC = b"MLXL"
PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 1  # 1: BATCH link records
KDF_INFO_LABEL = b"mlxcel link v1"
RANDOM_BYTES = 32
PUBKEY_BYTES = 32
MAC_BYTES = 32
MAX_NODE_ID_BYTES = 128
MAX_VERDICT_BYTES = 4096

MSG_CLIENT_HELLO = 1
MSG_SERVER_HELLO = 2
MSG_FINISHED = 3

FLAG_WANTS_BULK = 0x01

ROLE_CODES = {"prefill": 1, "decode": 2, "router": 3}
ROLE_NAMES = {code: name for name, code in ROLE_CODES.items()}

LABEL_C2S = b"mlxcel link v1 c2s"
LABEL_S2C = b"mlxcel link v1 s2c"
LABEL_BULK_C2S = b"mlxcel bulk v1 c2s"
LABEL_BULK_S2C = b"mlxcel bulk v1 s2c"

# magic, type, major, minor, role, flags, random, pubkey, node id length
_HELLO_HEAD = struct.Struct(f">4sBBBBB{RANDOM_BYTES}s{PUBKEY_BYTES}sB")
_FINISHED = struct.Struct(f">4sB{MAC_BYTES}s")


# ---------------------------------------------------------------- errors


class MalformedHandshake(HandshakeError):
    code = "handshake_malformed"


class UnexpectedMessage(HandshakeError):
    code = "handshake_unexpected"


class BadMac(HandshakeError):
    """The peer does not hold the same cluster secret, or the transcript was altered."""

    code = "handshake_bad_mac"


class BadKeyShare(HandshakeError):
    code = "handshake_bad_key_share"


class VersionMismatch(HandshakeError):
    code = "handshake_version_mismatch"

    def __init__(self, local: tuple[int, int], remote: tuple[int, int]):
        super().__init__(
            f"protocol version mismatch: local {local[0]}.{local[1]}, peer {remote[0]}.{remote[1]}"
        )
        self.local = local
        self.remote = remote


class RoleRefused(HandshakeError):
    code = "handshake_role_refused"


class PeerAtCapacity(HandshakeError):
    """The server is authenticated but full; dial again after ``retry_after_s``."""

    code = "handshake_at_capacity"

    def __init__(self, message: str, *, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


# ---------------------------------------------------------------- messages


@dataclass(frozen=True)
class Hello:
    msg_type: int
    major: int
    minor: int
    role: str
    flags: int
    random: bytes
    pubkey: bytes
    node_id: str

    def encode(self) -> bytes:
        node = self.node_id.encode()
        head = _HELLO_HEAD.pack(MAGIC, self.msg_type, self.major, self.minor,
                                ROLE_CODES[self.role], self.flags, self.random,
                                self.pubkey, len(node))
        return head + node


def check_node_id(node_id: str) -> None:
    n = len(node_id.encode())
    if not 1 <= n <= MAX_NODE_ID_BYTES:
        raise ValueError(f"node id must be 1..{MAX_NODE_ID_BYTES} UTF-8 bytes")


def _check_magic_and_type(data: bytes, msg_type: int) -> None:
    if data[:4] != MAGIC:
        raise MalformedHandshake("not an mlxcel link (bad magic)")
    if len(data) < 5 or data[4] != msg_type:
        raise UnexpectedMessage(f"expected handshake message {msg_type}")


def parse_hello(data: bytes, msg_type: int) -> tuple[Hello, bytes]:
    """Parse a HELLO of ``msg_type``; returns it and the trailing bytes (mac_s or empty)."""
    _check_magic_and_type(data, msg_type)
    if len(data) < _HELLO_HEAD.size:
        raise MalformedHandshake(f"HELLO of {len(data)} bytes is too short")
    _, typ, major, minor, role, flags, rnd, pub, n = _HELLO_HEAD.unpack_from(data)
    if role not in ROLE_NAMES:
        raise MalformedHandshake(f"unknown role code {role}")
    end = _HELLO_HEAD.size + n
    if n == 0 or len(data) < end:
        raise MalformedHandshake("HELLO node id is empty or truncated")
    try:
        node_id = bytes(data[_HELLO_HEAD.size:end]).decode()
    except UnicodeDecodeError:
        raise MalformedHandshake("HELLO node id is not UTF-8") from None
    hello = Hello(typ, major, minor, ROLE_NAMES[role], flags, rnd, pub, node_id)
    return hello, bytes(data[end:])


def encode_finished(mac: bytes) -> bytes:
    return _FINISHED.pack(MAGIC, MSG_FINISHED, mac)


def parse_finished(data: bytes) -> bytes:
    _check_magic_and_type(data, MSG_FINISHED)
    if len(data) != _FINISHED.size:
        raise MalformedHandshake(f"FINISHED of {len(data)} bytes, expected {_FINISHED.size}")
    return _FINISHED.unpack(data)[2]


# ---------------------------------------------------------------- verdict


class VerdictKind(enum.StrEnum):
    ACCEPT = "accept"
    AT_CAPACITY = "at_capacity"
    VERSION_MISMATCH = "version_mismatch"
    ROLE_REFUSED = "role_refused"


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    major: int = PROTOCOL_MAJOR
    minor: int = PROTOCOL_MINOR
    retry_after_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return msgpack.packb({
            "verdict": self.kind.value, "major": self.major, "minor": self.minor,
            "retry_after_s": float(self.retry_after_s), "extra": self.extra,
        })

    @classmethod
    def decode(cls, data: bytes | bytearray) -> Verdict:
        if len(data) > MAX_VERDICT_BYTES:
            raise MalformedHandshake("VERDICT is too large")
        try:
            body = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
            kind = VerdictKind(body["verdict"])
            extra = body.get("extra", {})
            retry = float(body.get("retry_after_s", 0.0))
            major, minor = int(body.get("major", 0)), int(body.get("minor", 0))
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException):
            raise MalformedHandshake("VERDICT is not a valid verdict map") from None
        if not isinstance(extra, dict):
            raise MalformedHandshake("VERDICT extra is not a map")
        return cls(kind, major, minor, retry, extra)


# ---------------------------------------------------------------- key schedule


@dataclass(frozen=True, repr=False)
class KeySchedule:
    """Everything HKDF gives; repr is redacted so keys never reach a log."""

    k_auth: bytes
    k_c2s: bytes
    k_s2c: bytes
    iv_c2s: bytes
    iv_s2c: bytes
    kb_c2s: bytes
    kb_s2c: bytes
    ivb_c2s: bytes
    ivb_s2c: bytes
    transcript_hash: bytes

    def __repr__(self) -> str:
        return "KeySchedule(<redacted>)"


_KEY_SIZES = (32, 32, 32, 4, 4, 32, 32, 4, 4)


def derive_keys(shared: bytes, secret: bytes, client_random: bytes, server_random: bytes,
                transcript: bytes) -> KeySchedule:
    """HKDF-SHA256(ikm = X25519 shared ‖ secret, salt = randoms, info = label ‖ H(transcript))."""
    th = hashlib.sha256(transcript).digest()
    okm = HKDF(hashes.SHA256(), sum(_KEY_SIZES), client_random + server_random,
               KDF_INFO_LABEL + th).derive(shared + secret)
    parts, at = [], 0
    for size in _KEY_SIZES:
        parts.append(okm[at:at + size])
        at += size
    return KeySchedule(*parts, transcript_hash=th)


def handshake_mac(keys: KeySchedule, side: bytes) -> bytes:
    return hmac.new(keys.k_auth, side + keys.transcript_hash, hashlib.sha256).digest()


def x25519_shared(private: X25519PrivateKey, peer_pub: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_pub))
    except ValueError:
        # Low-order points give an all-zero secret; cryptography refuses them.
        raise BadKeyShare("peer sent an invalid X25519 key share") from None


def secret_bytes(secret: ClusterSecret | bytes | None) -> bytes:
    if secret is None:
        raise ConfigError("a link needs the cluster secret; " + HOW_TO_MAKE_ONE)
    # ClusterSecret checks the length itself; raw bytes go through the same check.
    checked = secret if isinstance(secret, ClusterSecret) else ClusterSecret(bytes(secret))
    return checked.reveal()
