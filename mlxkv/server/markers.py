"""Text held back while it may still become a marker (``<tool_call>``, ``<think>``): an
answer streams token by token, and a marker can arrive split over several tokens."""

from __future__ import annotations


def pending(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
