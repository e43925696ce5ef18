"""Prompt lookup: proposals copied from where the context's last tokens occurred before.

For each n-gram size (longest first) the index maps an n-gram to where the tokens
after its latest earlier occurrence start; the context's own last n-gram is indexed
only once the next token arrives, so a lookup never finds itself.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One sequence's context (prompt + generated) and its n-gram index."""

    def __init__(self, ngram_min: int, ngram_max: int, tokens: Iterable[int] = ()):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> start of what followed it
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._index_last()
            self.tokens.append(token)

    def _index_last(self) -> None:
        """Index the n-grams ending at the current last token (before one more arrives)."""
        end = len(self.tokens)
        for n in self.sizes:
            if n <= end:
                self._after[tuple(self.tokens[end - n : end])] = end

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest earlier match of the context's end."""
        return self.lookup(limit)[1]

    def lookup(self, limit: int) -> tuple[int, list[int]]:
        """(the matched n-gram's size, up to ``limit`` tokens that followed it); (0, []): none."""
        end = len(self.tokens)
        if limit <= 0:
            return 0, []
        for n in self.sizes:
            if n > end:
                continue
            start = self._after.get(tuple(self.tokens[end - n : end]))
            if start is not None:
                return n, self.tokens[start : start + limit]
        return 0, []
