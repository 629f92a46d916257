"""The budget: weights + KV + runtime vs available memory, and the largest context/batch.

``mlxkv.memory.estimate.check_fits`` is what the engine calls before loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxkv.memory.layout import Layout
from mlxkv.memory.predictor import KVBytes, KVPredictor, prefill_schedule
from mlxkv.memory.runtime import Runtime, estimate
from mlxkv.memory.weights import Weights
from mlxkv.policy import KVPolicy

MAX_CONTEXT_SEARCH = 1 << 24  # 16.7M tokens: beyond that we say "unbounded"
MAX_BATCH_SEARCH = 1 << 20


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
    )


def budget(layout: Layout, weights: Weights, s: Setting, available: int) -> Budget:
    pred = KVPredictor(layout, s.policy, s.batch, s.kv_dtype)
    kv = pred.snapshot()
    for n in prefill_schedule(s.context, s.chunk):
        kv = pred.advance(n)
    rt = _runtime(layout, s, weights, kv, s.context)
    return Budget(kv, rt, weights, _total(weights, kv, rt), available)


def _bounded(layout: Layout, policy: KVPolicy) -> bool:
    """True when no cache grows without limit (windows everywhere, or states only)."""
    return policy.window is not None or not any(
        p.cls in ("KVCache", "QuantizedKVCache") for p in layout.specs()
    )


def max_context(layout: Layout, weights: Weights, s: Setting, available: int) -> int | None:
    """Largest prompt (prefilled in ``s.chunk`` calls) that fits; None: any length fits."""

    def fits_after(pred: KVPredictor, tokens: int) -> bool:
        kv = pred.snapshot()
        return _total(weights, kv, _runtime(layout, s, weights, kv, tokens)) <= available

    limit = MAX_CONTEXT_SEARCH
    if _bounded(layout, s.policy):
        windows = [p.window or 0 for p in layout.specs()]
        windows.append((s.policy.window or 0) + s.policy.sinks)
        limit = max(windows) + 4 * s.chunk + 512  # past this, nothing grows any more
    pred = KVPredictor(layout, s.policy, s.batch, s.kv_dtype)
    done = 0
    while done < limit:
        n = min(s.chunk, limit - done)
        pred.advance(n)
        if not fits_after(pred, done + n):
            break
        done += n
    else:
        return None if limit < MAX_CONTEXT_SEARCH else done
    # The last full chunk did not fit: find the largest remainder that does.
    base = KVPredictor(layout, s.policy, s.batch, s.kv_dtype)
    for m in prefill_schedule(done, s.chunk):
        base.advance(m)
    lo, hi = 0, n - 1  # remainder tokens known to fit / upper bound to try
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = base.copy()
        trial.advance(mid)
        if fits_after(trial, done + mid):
            lo = mid
        else:
            hi = mid - 1
    if done == 0 and lo == 0:
        return 0
    return done + lo


def max_batch(layout: Layout, weights: Weights, s: Setting, available: int) -> int:
    """Largest batch that fits at ``s.context`` (totals are linear in the batch)."""
    from dataclasses import replace

    def total(b: int) -> int:
        return budget(layout, weights, replace(s, batch=b), available).total

    t1 = total(1)
    if t1 > available:
        return 0
    slope = max(1, total(2) - t1)
    b = min(MAX_BATCH_SEARCH, 1 + (available - t1) // slope)
    while b > 1 and total(b) > available:
        b -= 1
    return b


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
