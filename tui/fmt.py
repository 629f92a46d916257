"""Short human-readable numbers for a narrow side panel."""

from __future__ import annotations

from mlxkv.memory.budget import human_bytes

__all__ = ["human_bytes", "tokens", "versus"]


def versus(actual: int, predicted: int | None) -> str:
    """How far the prediction is from what MLX holds: 'exact', or the signed gap."""
    if predicted is None:
        return "no prediction"
    gap = actual - predicted
    if gap == 0:
        return "exact"
    sign = "+" if gap > 0 else "-"
    pct = f" ({gap / predicted:+.1%})" if predicted else ""
    return f"actual {sign}{human_bytes(abs(gap))}{pct}"


def tokens(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n:,}"
