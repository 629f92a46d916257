"""Stop strings in a token stream: cut at the first match, hold back a possible prefix."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]

    def find(self, text: str, ends_after: int = 0) -> tuple[int, str] | None:
        """Where the earliest stop string in ``text`` that ends after ``ends_after`` begins,
        and which it is (the first given of those starting there), or None."""
        hits = [
            (i, s) for s in self.stops if (i := text.find(s, max(0, ends_after - len(s) + 1))) >= 0
        ]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def safe_length(self, text: str) -> int:
        """How much of ``text`` can be shown without showing the start of a stop string."""
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return len(text) - hold
