"""AES-256-GCM records: one direction of a link, sequence numbered, sans-I/O.

Record = ciphertext ‖ 16-byte tag. The sequence number is never sent: nonce =
4-byte IV prefix ‖ 64-bit big-endian sequence, AAD = direction label ‖ sequence,
so a replayed, reordered, dropped or truncated record fails authentication just
like a tampered one. Any failure poisons the receiver: the link must close.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    AEADEncryptionContext,
    Cipher,
    algorithms,
    modes,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mlxcel_plugin.errors import ProtocolError

TAG_BYTES = 16
IV_PREFIX_BYTES = 4
KEY_BYTES = 32
DEFAULT_MAX_RECORD_BYTES = 8 * 1024 * 1024  # plaintext bound; bigger payloads are chunked
_MAX_SEQ = 2**64 - 1
_SEQ = struct.Struct(">Q")


class RecordError(ProtocolError):
    code = "bad_record"


class RecordAuthError(RecordError):
    """Tag check failed: tampered, replayed, reordered, dropped or wrong key."""

    code = "record_auth_failed"


class RecordTooLarge(RecordError):
    code = "record_too_large"


class RecordTruncated(RecordError):
    code = "record_truncated"


class RecordStateError(RecordError):
    """Used after a failure, or the sequence space ran out."""

    code = "record_state"


def _check_key(key: bytes, iv_prefix: bytes) -> None:
    if len(key) != KEY_BYTES or len(iv_prefix) != IV_PREFIX_BYTES:
        raise ValueError("record key must be 32 bytes and IV prefix 4 bytes")


class _Direction:
    """Shared state of one direction: cipher, nonce layout, sequence."""

    def __init__(self, key: bytes, iv_prefix: bytes, label: bytes,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES):
        _check_key(key, iv_prefix)
        self._key = bytes(key)
        self._aead = AESGCM(key)
        self._algorithm = algorithms.AES(self._key)  # built once: it checks the key each time
        self._iv_prefix = bytes(iv_prefix)
        self._label = bytes(label)
        self.max_record_bytes = max_record_bytes
        self.seq = 0
        self._broken = False

    def _next_nonce_aad(self) -> tuple[bytes, bytes]:
        if self._broken:
            raise RecordStateError("record stream is closed after an earlier failure")
        if self.seq >= _MAX_SEQ:
            self._broken = True
            raise RecordStateError("record sequence exhausted; reconnect")
        packed = _SEQ.pack(self.seq)
        return self._iv_prefix + packed, self._label + packed

    def _cipher(self, nonce: bytes) -> Cipher:
        """The same AES-256-GCM record as ``_aead``, processed in pieces (gather / scatter)."""
        return Cipher(self._algorithm, modes.GCM(nonce))


class RecordSender(_Direction):
    """Seals plaintexts into records, reusing one output buffer (no per-call allocation)."""

    def __init__(self, key: bytes, iv_prefix: bytes, label: bytes,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES):
        super().__init__(key, iv_prefix, label, max_record_bytes)
        self._out = bytearray(0)

    def sealed_size(self, plaintext_len: int) -> int:
        return plaintext_len + TAG_BYTES

    def seal_into(self, plaintext: bytes | bytearray | memoryview,
                  out: bytearray | memoryview) -> int:
        """Seal into ``out`` (at least len(plaintext)+16 bytes); returns bytes written."""
        n = len(plaintext)
        if n > self.max_record_bytes:
            raise RecordTooLarge(f"record of {n} bytes exceeds bound {self.max_record_bytes}")
        nonce, aad = self._next_nonce_aad()
        target = memoryview(out)[: n + TAG_BYTES]
        self._aead.encrypt_into(nonce, plaintext, aad, target)
        self.seq += 1
        return n + TAG_BYTES

    def seal_parts_into(self, parts: Sequence[memoryview], out: bytearray | memoryview) -> int:
        """Seal the concatenation of ``parts`` as one record into ``out``, without joining them."""
        if len(parts) == 1:
            return self.seal_into(parts[0], out)
        n = sum(len(part) for part in parts)
        if n > self.max_record_bytes:
            raise RecordTooLarge(f"record of {n} bytes exceeds bound {self.max_record_bytes}")
        nonce, aad = self._next_nonce_aad()
        encryptor: AEADEncryptionContext = self._cipher(nonce).encryptor()
        encryptor.authenticate_additional_data(aad)
        target, at = memoryview(out), 0
        for part in parts:
            encryptor.update_into(part, target[at : at + len(part)])
            at += len(part)
        encryptor.finalize()
        target[at : at + TAG_BYTES] = encryptor.tag
        self.seq += 1
        return n + TAG_BYTES

    def seal(self, plaintext: bytes | bytearray | memoryview) -> memoryview:
        """Seal into the sender's own buffer; the view is valid until the next ``seal``."""
        need = len(plaintext) + TAG_BYTES
        if len(self._out) < need and len(plaintext) <= self.max_record_bytes:
            self._out = bytearray(need)  # grows to the largest record seen, then stays
        written = self.seal_into(plaintext, self._out)
        return memoryview(self._out)[:written]


class RecordReceiver(_Direction):
    """Opens records in order; the first bad one poisons the stream."""

    def opened_size(self, record_len: int) -> int:
        return record_len - TAG_BYTES

    def _check_size(self, record_len: int) -> None:
        if record_len < TAG_BYTES:
            self._broken = True
            raise RecordTruncated(f"record of {record_len} bytes is shorter than its tag")
        if record_len - TAG_BYTES > self.max_record_bytes:
            self._broken = True
            raise RecordTooLarge(
                f"record of {record_len - TAG_BYTES} bytes exceeds bound {self.max_record_bytes}"
            )

    def open_into(self, record: bytes | bytearray | memoryview,
                  out: bytearray | memoryview) -> int:
        """Open into ``out`` (at least len(record)-16 bytes); returns bytes written."""
        n = len(record)
        self._check_size(n)
        nonce, aad = self._next_nonce_aad()
        try:
            self._aead.decrypt_into(nonce, record, aad, memoryview(out)[: n - TAG_BYTES])
        except InvalidTag:
            self._fail_auth()
        self.seq += 1
        return n - TAG_BYTES

    def open_parts_into(self, record: memoryview, outs: Sequence[memoryview]) -> int:
        """Open one record into ``outs`` in turn (their lengths sum to the plaintext's)."""
        if len(outs) == 1:
            return self.open_into(record, outs[0])
        n = len(record)
        self._check_size(n)
        if sum(len(out) for out in outs) != n - TAG_BYTES:
            raise RecordError("scatter buffers do not add up to the record")
        nonce, aad = self._next_nonce_aad()
        decryptor: AEADDecryptionContext = self._cipher(nonce).decryptor()
        decryptor.authenticate_additional_data(aad)
        at = 0
        for out in outs:
            decryptor.update_into(record[at : at + len(out)], out)
            at += len(out)
        try:
            decryptor.finalize_with_tag(bytes(record[at:]))
        except InvalidTag:
            self._fail_auth()
        self.seq += 1
        return n - TAG_BYTES

    def _fail_auth(self) -> None:
        self._broken = True
        raise RecordAuthError(
            f"record {self.seq} failed authentication "
            "(tampered, replayed, reordered, dropped or wrong key)"
        ) from None

    def open(self, record: bytes | bytearray | memoryview) -> bytearray:
        """Open into a fresh buffer the caller keeps (frames hold views into it)."""
        self._check_size(len(record))
        out = bytearray(len(record) - TAG_BYTES)
        self.open_into(record, out)
        return out
