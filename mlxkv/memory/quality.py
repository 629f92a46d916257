"""What each KV policy costs in quality, as measured: data for ``plan --fit``'s ordering.

Perplexity ratios against the full unquantized cache, from docs/cache-quality.md
(SmolLM2-135M, austen.txt, chunks of 256, bounded policies keeping 1,024 tokens):

* unquantized and 8-bit rows: the "Results" table, column "ppl 1-8192" (12,288-token run),
  inside the trained context, where the full cache is at its best. Past the trained context
  the order flips (the sink cache is 27.49 there against 35.78 for the full cache), so these
  costs are the conservative ones.
* 4-bit rows, with the default KIVI keys (per channel, groups of 64 tokens, the newest
  incomplete group in full precision): ``full-q4`` / ``sink-q4`` over tokens 1-8192 of the
  8,192-token KIVI table (26.01 and 26.77, against 25.71 for the full unquantized cache).
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
    "sink": (26.53, FULL_PPL),
    "sink-q8": (26.53, FULL_PPL),
    "sink-q4": (26.77, FULL_PPL),  # tokens 1-8192, KIVI keys
    "window": (40.99, FULL_PPL),
}


@dataclass(frozen=True)
class Quality:
    cost: float | None  # perplexity ratio - 1 (0.032 = +3.2%); None: not measured
    note: str
    source: str | None  # where the number comes from


def kv_quality(
    window: int | None, sinks: int, key_bits: int | None, value_bits: int | None = None
) -> Quality:
    """The measured cost of a KV policy. Bits other than 8/4 and windows without sinks are
    matched to the nearest measured row (the note says which); keys and values at different
    widths are not in the table: cost None, sorted after every measured one."""
    if value_bits is None:
        value_bits = key_bits
    kind = "full" if window is None else ("sink" if sinks else "window")
    if key_bits != value_bits:
        return Quality(
            None,
            f"keys {key_bits} / values {value_bits} bits: not measured in docs/cache-quality.md",
            None,
        )
    bits = key_bits
    if bits is not None:
        kind += "-q8" if bits >= 8 else "-q4"
    row = PERPLEXITY.get(kind)
    if row is None:  # no quantized plain-window row: the plain window is the bound
        kind = "window"
        row = PERPLEXITY[kind]
    ppl, full = row
    cost = ppl / full - 1
    note = f"perplexity {ppl:.2f} vs {full:.2f} for the full cache ({cost:+.1%}, '{kind}'"
    if window is not None:
        note += ", measured with 1,024 tokens kept"
    if bits is not None and bits not in (4, 8):
        note += f", measured at {8 if bits >= 8 else 4} bits"
    note += ")"
    if window is not None and sinks:
        note += "; past the trained context it beats the full cache"
    return Quality(cost, note, SOURCE)


def lossless(note: str) -> Quality:
    """A change that leaves every token's output as it was (batch) or only drops tokens the
    request would have held (context)."""
    return Quality(0.0, note, None)
