"""Link handshake: sans-I/O client and server state machines (PSK + ephemeral X25519).

Each handshake message is one WebSocket binary message, fed to ``receive``;
``receive`` returns the bytes to send back (or None). The flow, as in TLS 1.3
``psk_dhe_ke`` / Noise ``NNpsk0``:

1. client HELLO   magic, version, role, flags, random, X25519 key, node id
2. server HELLO   same fields for the server + mac_s
3. client FINISHED mac_c
4. server VERDICT the first encrypted record (accept / at capacity / version / role)

The cluster secret enters only the HKDF input, so a wrong secret shows up as a
MAC failure and the ephemeral X25519 share gives forward secrecy. See
docs/protocol.md for byte layouts.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxcel_plugin.link.protocol.handshake_messages import (
    FLAG_WANTS_BULK,
    LABEL_BULK_C2S,
    LABEL_BULK_S2C,
    LABEL_C2S,
    LABEL_S2C,
    MAC_BYTES,
    MAX_VERDICT_BYTES,
    MSG_CLIENT_HELLO,
    MSG_SERVER_HELLO,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    RANDOM_BYTES,
    ROLE_CODES,
    BadMac,
    Hello,
    KeySchedule,
    MalformedHandshake,
    PeerAtCapacity,
    RoleRefused,
    UnexpectedMessage,
    Verdict,
    VerdictKind,
    VersionMismatch,
    check_node_id,
    derive_keys,
    encode_finished,
    handshake_mac,
    parse_finished,
    parse_hello,
    secret_bytes,
    x25519_shared,
)
from mlxcel_plugin.link.protocol.records import (
    DEFAULT_MAX_RECORD_BYTES,
    RecordError,
    RecordReceiver,
    RecordSender,
)
from mlxcel_plugin.link.protocol.secret import ClusterSecret

# ---------------------------------------------------------------- session

# Bulk lanes (parallel bulk TCP streams of one link): a client asks for up to
# MAX_BULK_LANES in its HELLO flags (bits 4-7 hold lanes - 1; a peer that predates
# lanes leaves them 0, i.e. one lane), authenticated with the rest of the transcript.
MAX_BULK_LANES = 16
_LANES_SHIFT = 4
_LANE_KDF_INFO = b"mlxcel bulk lane v1"


def lanes_flags(lanes: int) -> int:
    """The HELLO flag bits that ask for ``lanes`` bulk lanes (1..MAX_BULK_LANES)."""
    if not 1 <= lanes <= MAX_BULK_LANES:
        raise ValueError(f"bulk lanes must be 1..{MAX_BULK_LANES}, not {lanes}")
    return (lanes - 1) << _LANES_SHIFT


def lanes_from_flags(flags: int) -> int:
    return ((flags >> _LANES_SHIFT) & 0x0F) + 1


@dataclass(frozen=True)
class PeerInfo:
    role: str
    node_id: str
    major: int
    minor: int
    wants_bulk: bool = False
    bulk_lanes: int = 1  # lanes the (client) peer asked for; a server caps it at its own max


@dataclass
class Session:
    """The outcome of a handshake: who the peer is and the record streams to it."""

    is_client: bool
    peer: PeerInfo
    sender: RecordSender = field(repr=False)
    receiver: RecordReceiver = field(repr=False)
    keys: KeySchedule = field(repr=False)

    def bulk_records(self, max_record_bytes: int, lane: int = 0
                     ) -> tuple[RecordSender, RecordReceiver]:
        """Record streams for bulk lane ``lane`` (own keys, own sequence numbers).

        Lane 0 uses the handshake's bulk keys (as before lanes existed); lane i > 0
        gets keys and IV prefixes derived from them with the lane index in the HKDF
        info and its own AAD label, so no (key, nonce) pair is ever used on two lanes.
        """
        out, inn = (_bulk_direction(self.keys, lane, c2s=self.is_client),
                    _bulk_direction(self.keys, lane, c2s=not self.is_client))
        return (RecordSender(*out, max_record_bytes=max_record_bytes),
                RecordReceiver(*inn, max_record_bytes=max_record_bytes))

    def channel_mac(self, label: bytes, token: bytes) -> bytes:
        """A MAC binding an extra channel (a bulk lane's socket) to this handshake."""
        return hmac.new(self.keys.k_auth, label + token + self.keys.transcript_hash,
                        hashlib.sha256).digest()


def _bulk_direction(keys: KeySchedule, lane: int, *, c2s: bool) -> tuple[bytes, bytes, bytes]:
    """(key, IV prefix, AAD label) of one direction of bulk lane ``lane``."""
    key, iv, label = ((keys.kb_c2s, keys.ivb_c2s, LABEL_BULK_C2S) if c2s
                      else (keys.kb_s2c, keys.ivb_s2c, LABEL_BULK_S2C))
    if lane == 0:
        return key, iv, label
    if not 0 < lane < MAX_BULK_LANES:
        raise ValueError(f"bulk lane {lane} is outside 0..{MAX_BULK_LANES - 1}")
    info = _LANE_KDF_INFO + label + struct.pack(">B", lane)
    okm = HKDF(hashes.SHA256(), 36, keys.transcript_hash, info).derive(key + iv)
    return okm[:32], okm[32:], label + b" lane %d" % lane


def _make_session(is_client: bool, peer: PeerInfo, keys: KeySchedule,
                  max_record_bytes: int) -> Session:
    c2s = (keys.k_c2s, keys.iv_c2s, LABEL_C2S)
    s2c = (keys.k_s2c, keys.iv_s2c, LABEL_S2C)
    out, inn = (c2s, s2c) if is_client else (s2c, c2s)
    return Session(is_client, peer,
                   RecordSender(*out, max_record_bytes=max_record_bytes),
                   RecordReceiver(*inn, max_record_bytes=max_record_bytes), keys)


# ---------------------------------------------------------------- state machines


class State(enum.Enum):
    START = "start"
    WAIT_SERVER_HELLO = "wait_server_hello"
    WAIT_VERDICT = "wait_verdict"
    WAIT_CLIENT_HELLO = "wait_client_hello"
    WAIT_FINISHED = "wait_finished"
    DONE = "done"
    FAILED = "failed"


class _Handshake:
    def __init__(self, secret: ClusterSecret | bytes, role: str, node_id: str,
                 rng: Callable[[int], bytes], major: int, minor: int, max_record_bytes: int):
        if role not in ROLE_CODES:
            raise ValueError(f"unknown link role {role!r}; expected one of {sorted(ROLE_CODES)}")
        check_node_id(node_id)
        self._secret = secret_bytes(secret)
        self.role, self.node_id = role, node_id
        self.major, self.minor = major, minor
        self._private = X25519PrivateKey.from_private_bytes(rng(32))
        self._random = rng(RANDOM_BYTES)
        self._max_record_bytes = max_record_bytes
        self.session: Session | None = None
        self.verdict: Verdict | None = None
        self.peer: PeerInfo | None = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(role={self.role!r}, node_id={self.node_id!r}, "
                f"state={self.state.value})")

    def _hello(self, msg_type: int, flags: int) -> Hello:
        pub = self._private.public_key().public_bytes_raw()
        return Hello(msg_type, self.major, self.minor, self.role, flags, self._random, pub,
                     self.node_id)

    def _expect(self, state: State) -> None:
        if self.state is not state:
            raise UnexpectedMessage(f"handshake message received in state {self.state.value}")

    @property
    def done(self) -> bool:
        return self.state is State.DONE

    def receive(self, message: bytes) -> bytes | None:
        """Feed one handshake message; returns the reply to send, if any."""
        try:
            return self._receive(bytes(message))
        except Exception:
            self.state = State.FAILED  # no second chance after any failure
            raise

    def _receive(self, message: bytes) -> bytes | None:
        raise NotImplementedError


class ClientHandshake(_Handshake):
    """Dialing side: ``start()`` then ``receive()`` each server message until ``done``."""

    def __init__(self, secret: ClusterSecret | bytes, role: str, node_id: str, *,
                 want_bulk: bool = False, bulk_lanes: int = 1,
                 expect_roles: Collection[str] | None = None,
                 rng: Callable[[int], bytes] = os.urandom, major: int = PROTOCOL_MAJOR,
                 minor: int = PROTOCOL_MINOR,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES):
        super().__init__(secret, role, node_id, rng, major, minor, max_record_bytes)
        self._flags = (FLAG_WANTS_BULK | lanes_flags(bulk_lanes)) if want_bulk else 0
        self._expect_roles = frozenset(expect_roles) if expect_roles else None
        self._client_hello = b""
        self.state = State.START

    def start(self) -> bytes:
        self._expect(State.START)
        self._client_hello = self._hello(MSG_CLIENT_HELLO, self._flags).encode()
        self.state = State.WAIT_SERVER_HELLO
        return self._client_hello

    def _receive(self, message: bytes) -> bytes | None:
        if self.state is State.WAIT_SERVER_HELLO:
            return self._on_server_hello(message)
        self._expect(State.WAIT_VERDICT)
        self._on_verdict(message)
        return None

    def _on_server_hello(self, message: bytes) -> bytes:
        hello, mac_s = parse_hello(message, MSG_SERVER_HELLO)
        if len(mac_s) != MAC_BYTES:
            raise MalformedHandshake("server HELLO has no valid MAC")
        transcript = self._client_hello + message[: len(message) - MAC_BYTES]
        shared = x25519_shared(self._private, hello.pubkey)
        keys = derive_keys(shared, self._secret, self._random, hello.random, transcript)
        if not hmac.compare_digest(mac_s, handshake_mac(keys, b"server")):
            raise BadMac("server HELLO MAC does not verify: different cluster secret, "
                         "or the handshake was altered")
        self.peer = PeerInfo(hello.role, hello.node_id, hello.major, hello.minor)
        self.session = _make_session(True, self.peer, keys, self._max_record_bytes)
        self.state = State.WAIT_VERDICT
        return encode_finished(handshake_mac(keys, b"client"))

    def _on_verdict(self, message: bytes) -> None:
        if len(message) > MAX_VERDICT_BYTES:
            raise MalformedHandshake("VERDICT record is too large")
        try:
            plain = self.session.receiver.open(message)
        except RecordError as exc:
            raise BadMac(f"VERDICT record does not verify: {exc.message}") from None
        self.verdict = Verdict.decode(plain)
        self._raise_for_verdict(self.verdict)
        self.state = State.DONE

    def _raise_for_verdict(self, verdict: Verdict) -> None:
        peer = self.peer
        if verdict.kind is VerdictKind.AT_CAPACITY:
            raise PeerAtCapacity(f"peer {peer.node_id} is at capacity",
                                 retry_after_s=verdict.retry_after_s)
        if verdict.kind is VerdictKind.VERSION_MISMATCH:
            raise VersionMismatch((self.major, self.minor), (verdict.major, verdict.minor))
        if verdict.kind is VerdictKind.ROLE_REFUSED:
            raise RoleRefused(f"peer {peer.node_id} ({peer.role}) refused role {self.role}")
        if self._expect_roles is not None and peer.role not in self._expect_roles:
            raise RoleRefused(f"peer {peer.node_id} has role {peer.role}, "
                              f"expected one of {sorted(self._expect_roles)}")


class ServerHandshake(_Handshake):
    """Accepting side: ``receive()`` the client HELLO, then FINISHED (returns the VERDICT).

    The verdict is decided when FINISHED verifies: version, then role, then
    ``at_capacity()``; on accept, ``accept_extra(session)`` may add fields
    (the link layer announces its bulk channel there).
    """

    def __init__(self, secret: ClusterSecret | bytes, role: str, node_id: str,
                 accept_roles: Collection[str], *,
                 at_capacity: Callable[[], float | None] | None = None,
                 accept_extra: Callable[[Session], dict[str, Any]] | None = None,
                 rng: Callable[[int], bytes] = os.urandom, major: int = PROTOCOL_MAJOR,
                 minor: int = PROTOCOL_MINOR,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES):
        super().__init__(secret, role, node_id, rng, major, minor, max_record_bytes)
        self._accept_roles = frozenset(accept_roles)
        # Asked at FINISHED time: None = room, else the retry-after to announce.
        self._at_capacity = at_capacity
        self._accept_extra = accept_extra
        self._keys: KeySchedule | None = None
        self.state = State.WAIT_CLIENT_HELLO

    def _receive(self, message: bytes) -> bytes | None:
        if self.state is State.WAIT_CLIENT_HELLO:
            return self._on_client_hello(message)
        self._expect(State.WAIT_FINISHED)
        return self._on_finished(message)

    def _on_client_hello(self, message: bytes) -> bytes:
        hello, rest = parse_hello(message, MSG_CLIENT_HELLO)
        if rest:
            raise MalformedHandshake("client HELLO has trailing bytes")
        body = self._hello(MSG_SERVER_HELLO, 0).encode()
        shared = x25519_shared(self._private, hello.pubkey)
        self._keys = derive_keys(shared, self._secret, hello.random, self._random, message + body)
        self.peer = PeerInfo(hello.role, hello.node_id, hello.major, hello.minor,
                             wants_bulk=bool(hello.flags & FLAG_WANTS_BULK),
                             bulk_lanes=lanes_from_flags(hello.flags))
        self.state = State.WAIT_FINISHED
        return body + handshake_mac(self._keys, b"server")

    def _on_finished(self, message: bytes) -> bytes:
        mac_c = parse_finished(message)
        if not hmac.compare_digest(mac_c, handshake_mac(self._keys, b"client")):
            raise BadMac(f"client {self.peer.node_id} FINISHED MAC does not verify: "
                         "different cluster secret, or the handshake was altered")
        self.session = _make_session(False, self.peer, self._keys, self._max_record_bytes)
        self.verdict = self._decide()
        self.state = State.DONE
        return bytes(self.session.sender.seal(self.verdict.encode()))

    def _decide(self) -> Verdict:
        """Version first (a newer peer may use roles we don't know), then role, then capacity."""
        peer, ours = self.peer, (self.major, self.minor)
        if peer.major != self.major:
            return Verdict(VerdictKind.VERSION_MISMATCH, *ours)
        if peer.role not in self._accept_roles:
            return Verdict(VerdictKind.ROLE_REFUSED, *ours)
        retry_after_s = self._at_capacity() if self._at_capacity else None
        if retry_after_s is not None:
            return Verdict(VerdictKind.AT_CAPACITY, *ours, retry_after_s=retry_after_s)
        # Called only on accept: the I/O layer reserves a slot / bulk token here.
        extra = self._accept_extra(self.session) if self._accept_extra else {}
        return Verdict(VerdictKind.ACCEPT, *ours, extra=extra)
