"""What each KV policy costs in quality, as measured: data for ``plan --fit``'s ordering.

Perplexity ratios against the full unquantized cache, from docs/cache-quality.md
(SmolLM2-135M, austen.txt, chunks of 256, bounded policies keeping 1,024 tokens):

* unquantized rows: the "Results" table, column "ppl 1-8192" (12,288-token run),
  inside the trained context, where the full cache is at its best. Past the trained context
  the order flips (the sink cache is 27.49 there against 35.78 for the full cache), so these
  costs are the conservative ones.
* 8-, 4-, 3- and 2-bit rows and keys 4 / values 2, with the default KIVI keys (per channel,
  groups of 64 tokens, the newest incomplete group in full precision): the 8,192-token KIVI
  table, tokens 1-8192 (e.g. ``full-q4`` 26.01, ``sink-q4`` 26.77, against 25.71 for the
  full unquantized cache).
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = "docs/cache-quality.md, perplexity of SmolLM2-135M on austen.txt"
FULL_PPL = 25.71
# policy -> (perplexity, the full unquantized cache's perplexity over the same tokens)
PERPLEXITY = {
    "full": (25.71, FULL_PPL),
    "full-q8": (25.71, FULL_PPL),
    "full-q4": (26.01, FULL_PPL),  # tokens 1-8192, KIVI keys
    "full-q3": (27.53, FULL_PPL),
    "full-q2": (46.04, FULL_PPL),
    "sink": (26.53, FULL_PPL),
    "sink-q8": (26.53, FULL_PPL),
    "sink-q4": (26.77, FULL_PPL),  # tokens 1-8192, KIVI keys
    "sink-q3": (28.05, FULL_PPL),
    "sink-q2": (38.31, FULL_PPL),
    "sink-k4v2": (30.61, FULL_PPL),  # value groups of 64 (the default)
    "window": (40.99, FULL_PPL),
}


@dataclass(frozen=True)
class Quality:
    cost: float | None  # perplexity ratio - 1 (0.032 = +3.2%); None: not measured
    note: str
    source: str | None  # where the number comes from


def _row_name(kind: str, key_bits: int | None, value_bits: int | None) -> str | None:
    """The measured row for these widths: equal widths at the nearest measured width at or
    below them (a wider cache costs no more), keys/values apart only as measured."""
    if key_bits is None and value_bits is None:
        return kind
    if key_bits != value_bits:
        name = f"{kind}-k{key_bits}v{value_bits}"
        return name if name in PERPLEXITY else None
    for b in (8, 4, 3, 2):
        if key_bits >= b and f"{kind}-q{b}" in PERPLEXITY:
            return f"{kind}-q{b}"
    return None


def kv_quality(
    window: int | None, sinks: int, key_bits: int | None, value_bits: int | None = None
) -> Quality:
    """The measured cost of a KV policy. Widths without a row take the nearest narrower
    measured one, windows without sinks the plain window (the note says which); keys and
    values at different widths that were not measured: cost None, sorted after every
    measured one."""
    if value_bits is None:
        value_bits = key_bits
    kind = "full" if window is None else ("sink" if sinks else "window")
    name = _row_name(kind, key_bits, value_bits)
    if name is None and kind != "window":
        return Quality(
            None,
            f"keys {key_bits} / values {value_bits} bits: not measured in docs/cache-quality.md",
            None,
        )
    if name is None or name not in PERPLEXITY:  # no quantized plain-window row: the bound
        name = "window"
    ppl, full = PERPLEXITY[name]
    cost = ppl / full - 1
    note = f"perplexity {ppl:.2f} vs {full:.2f} for the full cache ({cost:+.1%}, '{name}'"
    if window is not None:
        note += ", measured with 1,024 tokens kept"
    measured_bits = name.rsplit("-q", 1)[1] if "-q" in name else None
    if measured_bits is not None and key_bits is not None and int(measured_bits) != key_bits:
        note += f", measured at {measured_bits} bits"
    note += ")"
    if window is not None and sinks:
        note += "; past the trained context it beats the full cache"
    return Quality(cost, note, SOURCE)


def lossless(note: str) -> Quality:
    """A change that leaves every token's output as it was (batch) or only drops tokens the
    request would have held (context)."""
    return Quality(0.0, note, None)
