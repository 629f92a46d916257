"""Short human-readable numbers for a narrow side panel."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "n/a"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.1f} {_UNITS[unit]}" if abs(value) < 100 else f"{value:.0f} {_UNITS[unit]}"


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
