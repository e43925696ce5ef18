"""Streaming detokenizer: emits text as tokens arrive, never half a character.

Decodes a short window (a few already-emitted tokens plus the new ones) and
emits only what the window adds; a window ending in U+FFFD is an incomplete
UTF-8 sequence split across byte tokens, so it waits for the next token.
The concatenated output equals ``tokenizer.decode(all_ids)``.

With a ``piece`` lookup (tokenizers whose decode is plain concatenation), a
token that follows fully emitted text is its own delta: no decode at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

REPLACEMENT_CHAR = "\ufffd"

Decode = Callable[[Sequence[int]], str]
Piece = Callable[[int], "str | None"]


class IncrementalDetokenizer:
    """Token ids in, text deltas out (see the module docstring).

    ``kept_special`` maps special token ids that must reach the stream filter
    (e.g. a model's tool-call token) to their text; other special tokens are
    skipped like the full decode skips them.
    """

    def __init__(self, decode: Decode, kept_special: Mapping[int, str] | None = None,
                 piece: Piece | None = None):
        self._decode = decode
        self._piece = piece
        self._kept = dict(kept_special or {})
        self._ids: list[int] = []
        self._prefix = 0  # window start: context so leading-space rules apply as in a full decode
        self._read = 0  # tokens before this index were emitted

    def add(self, token_id: int) -> str:
        if token_id in self._kept:
            text = self.flush() + self._kept[token_id]
            self._restart()
            return text
        self._ids.append(token_id)
        if self._piece is not None and self._read == len(self._ids) - 1:
            text = self._piece(token_id)
            if text is not None:  # what the window below would give, without decoding
                if text:
                    self._prefix, self._read = self._read, len(self._ids)
                return text
        emitted = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if len(window) <= len(emitted) or window.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(emitted) :]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD)."""
        emitted = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return window[len(emitted) :]

    def _restart(self) -> None:
        self._ids.clear()
        self._prefix = self._read = 0
