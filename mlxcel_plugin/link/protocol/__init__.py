"""The link protocol's sans-I/O half: bytes in, frames and bytes out, no sockets.

``secret`` loads the cluster secret; ``handshake`` authenticates both ends and
derives the session keys; ``records`` seals and opens AES-256-GCM records;
``record_reader`` says what a record's plaintext holds; ``frames`` and
``body_parts`` are the frame codec; ``checksum`` is the crc32 over tensor bytes.
The wire format is in docs/protocol.md.
"""
