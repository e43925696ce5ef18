"""Stop strings: cut the output before the first stop string.

Text that could be the start of a stop string is held back until the next
piece decides it, so nothing after a stop string ever leaves.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the output, once one did

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit, whether a stop string was hit)``."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        found = self._first_stop(buffer)
        if found is not None:
            cut, self.matched = found
            self._held = ""
            return buffer[:cut], True
        keep = self._partial_suffix_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """Release held text at the end of the output (it was not a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """(where the earliest stop string starts, that string); the first listed on a tie."""
        found = [(i, n) for n, i in enumerate(buffer.find(s) for s in self._stops) if i >= 0]
        if not found:
            return None
        cut, which = min(found)
        return cut, self._stops[which]

    def _partial_suffix_len(self, buffer: str) -> int:
        longest = min(len(buffer), max(len(s) for s in self._stops) - 1)
        for k in range(longest, 0, -1):
            tail = buffer[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
