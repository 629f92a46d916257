"""The budget: weights + KV + runtime vs available memory, and the largest context/batch.

Every answer is closed-form in the context and the batch (``KVPredictor.prefill`` and
binary searches over monotone totals), so ``plan`` answers at once for any context.
``mlxkv.memory.estimate.check_fits`` is what the engine calls before loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxkv.memory.layout import Layout
from mlxkv.memory.predictor import KVBytes, KVPredictor
from mlxkv.memory.runtime import Runtime, estimate
from mlxkv.memory.weights import Weights
from mlxkv.policy import KVPolicy

MAX_CONTEXT_SEARCH = 1 << 50  # past this, an unbounded cache is reported as this many tokens
MAX_BATCH_SEARCH = 1 << 40


@dataclass(frozen=True)
class Setting:
    """What the user plans to run."""

    context: int
    batch: int = 1
    chunk: int = 512
    policy: KVPolicy = field(default_factory=KVPolicy)
    kv_dtype: str = "float32"
    backend: str = "cpu"


@dataclass(frozen=True)
class Budget:
    kv: KVBytes
    runtime: Runtime
    weights: Weights
    total: int
    available: int

    @property
    def fits(self) -> bool:
        return self.total <= self.available


def _total(weights: Weights, kv: KVBytes, rt: Runtime) -> int:
    return (
        weights.bytes
        + kv.peak_allocated
        + rt.activation_bytes
        + rt.logits_bytes
        + rt.overhead_bytes
    )


def _runtime(layout: Layout, s: Setting, weights: Weights, kv: KVBytes, tokens: int) -> Runtime:
    return estimate(
        layout,
        tokens,
        s.batch,
        s.chunk,
        s.kv_dtype,
        weights.bytes,
        kv.peak_allocated,
        s.backend,
        None if s.policy.window is None else s.policy.window + s.policy.sinks,
        quantized=s.policy.bits is not None,
        sinks=s.policy.sinks,
    )


def budget(layout: Layout, weights: Weights, s: Setting, available: int) -> Budget:
    kv = KVPredictor(layout, s.policy, s.batch, s.kv_dtype).prefill(s.context, s.chunk)
    rt = _runtime(layout, s, weights, kv, s.context)
    return Budget(kv, rt, weights, _total(weights, kv, rt), available)


def _bounded(layout: Layout, policy: KVPolicy) -> bool:
    """True when no cache grows without limit (windows everywhere, or states only)."""
    return policy.window is not None or not any(
        p.cls in ("KVCache", "QuantizedKVCache") for p in layout.specs()
    )


def largest(fits, lo: int, hi: int) -> int:
    """Largest x in [lo, hi] with fits(x), given fits(lo) and fits monotone (true, then false)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def max_context(layout: Layout, weights: Weights, s: Setting, available: int) -> int | None:
    """Largest prompt (prefilled in ``s.chunk`` calls) that fits; None: any length fits.

    The peak after k full chunks only grows with k (it is a peak over more calls), and a
    larger last chunk costs more: two binary searches, on full chunks then the remainder.
    """
    from dataclasses import replace

    def fits(tokens: int) -> bool:
        return budget(layout, weights, replace(s, context=tokens), available).fits

    limit = MAX_CONTEXT_SEARCH
    if _bounded(layout, s.policy):
        windows = [p.window or 0 for p in layout.specs()]
        windows.append((s.policy.window or 0) + s.policy.sinks)
        limit = max(windows) + 4 * s.chunk + 512  # past this, nothing grows any more
    if fits(limit):
        return None if limit < MAX_CONTEXT_SEARCH else limit
    if not fits(1):
        return 0
    chunks = largest(lambda k: k == 0 or fits(k * s.chunk), 0, limit // s.chunk)
    done = chunks * s.chunk
    first = 0 if done else 1  # fits(1) is known
    return done + largest(lambda r: r == first or fits(done + r), first, max(first, s.chunk - 1))


def max_batch(layout: Layout, weights: Weights, s: Setting, available: int) -> int:
    """Largest batch that fits at ``s.context`` (totals grow with the batch)."""
    from dataclasses import replace

    def fits(b: int) -> bool:
        return budget(layout, weights, replace(s, batch=b), available).fits

    if not fits(1):
        return 0
    return largest(fits, 1, MAX_BATCH_SEARCH)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: int | float | None) -> str:
    """Bytes in the unit that keeps them short: '900 MiB', '1.6 GiB', '512 B'."""
    if n is None:
        return "n/a"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.1f} {_UNITS[unit]}" if abs(value) < 100 else f"{value:.0f} {_UNITS[unit]}"
