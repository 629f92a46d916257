"""``plan --fit``: settings that fit, as the flags to pass, cheapest in quality first.

Each candidate changes the request as little as it can (the largest window, the largest
batch, the longest context that fits) and is kept only if its re-plan fits and the engine
would run it (no full cache past the trained context). Ordered by measured quality cost
(``mlxkv.memory.quality``, from docs/cache-quality.md; unmeasured last), then by memory left.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxkv.memory.budget import Budget, Setting, budget, max_batch, max_context
from mlxkv.memory.context import past_trained_context
from mlxkv.memory.estimate import Estimate, check_policy, with_weight_bits
from mlxkv.memory.layout import Layout
from mlxkv.memory.quality import Quality, kv_quality, lossless
from mlxkv.memory.weights import Weights, from_layout
from mlxkv.policy import KVPolicy, PolicyError

MAX_SUGGESTIONS = 8
# The largest split --fit proposes: tensor parallelism pays a collective per layer, so few
# hosts; a pipeline only hands activations on, one host to the next.
MAX_HOSTS = {"tensor": 8, "pipeline": 64}
DEFAULT_SINKS = 4
ROUND = 256  # windows and contexts are proposed in multiples of this (when that large)
WEIGHT_BITS = 4


@dataclass(frozen=True)
class Suggestion:
    flags: tuple[str, ...]  # options to set (or replace) in the user's command
    setting: Setting
    weight_bits: int | None
    budget: Budget
    quality: Quality
    kv_cost: float | None  # the KV policy's measured cost (orders suggestions of equal quality)

    @property
    def spare(self) -> int:
        return self.budget.available - self.budget.total

    def to_dict(self) -> dict:
        return {
            "flags": list(self.flags),
            "total_bytes": self.budget.total,
            "spare_bytes": self.spare,
            "quality_cost": self.quality.cost,
            "kv_quality_cost": self.kv_cost,
            "quality_note": self.quality.note,
            "quality_source": self.quality.source,
        }


def _round(n: int) -> int:
    return n // ROUND * ROUND if n >= 2 * ROUND else n


def _widths(p: KVPolicy) -> tuple[int | None, int | None]:
    return p.key_bits, p.value_bits


def _with_widths(p: KVPolicy, key: int | None, value: int | None) -> KVPolicy:
    return replace(p, bits=None, key_bits=key, value_bits=value)


def _policy_flags(base: KVPolicy, p: KVPolicy) -> list[str]:
    flags = []
    if p.window != base.window:
        flags += ["--kv-window", str(p.window)]
    if p.window is not None and (p.sinks != base.sinks or p.window != base.window):
        flags += ["--kv-sinks", str(p.sinks)]
    key, value = _widths(p)
    if (key, value) != _widths(base):
        # A quantized command may hold --kv-key-bits/--kv-value-bits, which override
        # --kv-bits: name the same flags, so that adding them takes effect.
        if key == value and base.bits is None:
            flags += ["--kv-bits", str(key)]
        else:
            flags += ["--kv-key-bits", str(key), "--kv-value-bits", str(value)]
    return flags


def _cheaper_widths(base: KVPolicy) -> list[tuple[int | None, int | None]]:
    """The base's key/value widths, then 8/8, 4/4 and 4/2 where smaller."""
    options = [(8, 8), (4, 4), (4, 2)]
    key, value = _widths(base)
    now = (key or 16) + (value or 16)
    return [(key, value)] + [(k, v) for k, v in options if k + v < now]


class _Search:
    def __init__(self, est: Estimate):
        self.est = est
        self.available = est.budget.available
        self.limit = est.trained_context
        self.found: dict[tuple, Suggestion] = {}

    def runs(self, layout: Layout, weights: Weights, s: Setting) -> Budget | None:
        b = budget(layout, weights, s, self.available)
        if b.fits and not past_trained_context(self.limit, s.policy.window, s.context):
            return b
        return None

    def add(self, flags, s, wbits, layout, weights, quality, kv_cost=None) -> bool:
        """Keep the candidate if it runs; True when it does."""
        b = self.runs(layout, weights, s)
        if b is not None and flags:
            found = Suggestion(tuple(flags), s, wbits, b, quality, kv_cost)
            self.found.setdefault(tuple(flags), found)
        return b is not None

    def largest_window(self, layout, weights, s: Setting, sinks: int) -> int | None:
        """The largest window (with ``sinks``) that fits, below the context it bounds."""
        cap = s.context - sinks - 1
        if self.limit:
            cap = min(cap, self.limit - sinks)
        if s.policy.window is not None:
            cap = min(cap, s.policy.window - 1)
        lo = sinks + 1  # a window holds more than its sinks
        if cap < lo:
            return None

        def at(w: int) -> Setting:
            return replace(s, policy=replace(s.policy, window=w, sinks=sinks))

        if self.runs(layout, weights, at(lo)) is None:
            return None
        hi = cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.runs(layout, weights, at(mid)) is not None:
                lo = mid
            else:
                hi = mid - 1
        return lo if lo == cap else _round(lo)  # the trained context binds: use all of it

    def policies(self, layout, weights, wbits: int | None, prefix: list[str]) -> None:
        base = self.est.setting
        for key, value in _cheaper_widths(base.policy):
            p = _with_widths(base.policy, key, value)
            try:
                check_policy(layout, p)
            except PolicyError:
                continue
            s = replace(base, policy=p)
            quality = kv_quality(p.window, p.sinks, *_widths(p))
            kv_cost = quality.cost
            if wbits is not None:
                quality = _with_weights(quality, wbits)
            flags = prefix + _policy_flags(base.policy, p)
            if self.add(flags, s, wbits, layout, weights, quality, kv_cost):
                continue  # it runs without a (smaller) window
            sinks = p.sinks if p.window is not None else DEFAULT_SINKS
            try:
                check_policy(layout, replace(p, window=sinks + 1, sinks=sinks))
            except PolicyError:
                continue
            w = self.largest_window(layout, weights, s, sinks)
            if w is not None:
                pw = replace(p, window=w, sinks=sinks)
                sw = replace(base, policy=pw)
                quality = kv_quality(pw.window, pw.sinks, *_widths(pw))
                kv_cost = quality.cost
                if wbits is not None:
                    quality = _with_weights(quality, wbits)
                flags = prefix + _policy_flags(base.policy, pw)
                self.add(flags, sw, wbits, layout, weights, quality, kv_cost)

    def hosts(self) -> None:
        """The fewest hosts like this one (same --memory) that hold it, for each way
        mlx-lm splits the model (mlxkv.memory.hosts); only for memory, not for the
        trained context."""
        from mlxkv.memory.config import BadInput
        from mlxkv.memory.hosts import fewest_hosts, split_support

        est = self.est
        if est.past_trained_context or (est.memory_arg and "," in est.memory_arg):
            return
        try:
            can = split_support(est.config)
        except BadInput:  # mlx-lm cannot build it: no split to propose
            return
        for mode in (m for m, ok in can.items() if ok):
            most, memory = MAX_HOSTS[mode], est.memory_arg
            hp = fewest_hosts(est.config, est.layout, est.setting, mode, memory, most)
            if hp is None:
                continue
            n = len(hp.hosts)
            q = lossless(f"{n} machines like this one ({mode} parallel, mlx.launch): same outputs")
            flags = ("--hosts", str(n), "--shard", mode)
            b = hp.tightest.budget
            self.found.setdefault(flags, Suggestion(flags, est.setting, None, b, q, 0.0))

    def shape(self) -> None:
        """A smaller batch or a shorter context, the policy as asked."""
        est, base = self.est, self.est.setting
        layout, weights = est.layout, est.budget.weights
        if base.batch > 1:
            b = max_batch(layout, weights, base, self.available)
            if b >= 1:
                q = lossless(f"batch {b} instead of {base.batch}: same outputs, fewer at once")
                self.add(["--batch", str(b)], replace(base, batch=b), None, layout, weights, q)
        mc = max_context(layout, weights, base, self.available)
        if mc is None:
            mc = base.context
        if self.limit and base.policy.window is None:
            mc = min(mc, self.limit)
        mc = _round(mc)
        if 1 <= mc < base.context:
            q = lossless(f"{mc:,} tokens instead of {base.context:,}: longer prompts are refused")
            self.add(["--context", str(mc)], replace(base, context=mc), None, layout, weights, q)


def _with_weights(q: Quality, bits: int) -> Quality:
    note = (
        f"weights quantized to {bits} bits (mlx_lm.convert -q, group 64): quality not "
        f"measured by mlxkv; KV: {q.note}"
    )
    return Quality(None, note, q.source)  # the source backs the KV part


def window_instead(est: Estimate) -> dict | None:
    """For a full cache past the trained context: the window that keeps every distance in
    range (``trained - sinks``), or the largest that fits if that one does not."""
    if not est.past_trained_context:
        return None
    s, limit = est.setting, est.trained_context
    w = limit - DEFAULT_SINKS
    if w <= DEFAULT_SINKS:
        return None
    layout, weights = est.layout, est.budget.weights
    at = replace(s, policy=replace(s.policy, window=w, sinks=DEFAULT_SINKS))
    b = budget(layout, weights, at, est.budget.available)
    if not b.fits:
        smaller = _Search(est).largest_window(layout, weights, s, DEFAULT_SINKS)
        if smaller is not None:
            w = smaller
            at = replace(s, policy=replace(s.policy, window=w, sinks=DEFAULT_SINKS))
            b = budget(layout, weights, at, est.budget.available)
    flags = ["--kv-window", str(w), "--kv-sinks", str(DEFAULT_SINKS)]
    return {"flags": flags, "total_bytes": b.total, "fits": b.fits}


def suggest(est: Estimate) -> list[Suggestion]:
    """Settings that fit where ``est`` does not (empty when it already runs)."""
    if est.runnable:
        return []
    search = _Search(est)
    search.policies(est.layout, est.budget.weights, None, [])
    search.shape()
    search.hosts()
    facts = est.layout.facts
    from mlxkv.memory.dtypes import default_weight_dtype, is_gpu

    on = est.setting.backend
    if is_gpu(on) and not facts.quantized and est.weight_bits is None:
        # A GPU keeps quantized weights packed: an MLX conversion shrinks what is resident.
        from mlxkv.memory.store import layout_for

        config = with_weight_bits(est.source.config, WEIGHT_BITS)
        layout = layout_for(config)
        weights = from_layout(layout.facts, default_weight_dtype(config, on), False)
        search.policies(layout, weights, WEIGHT_BITS, ["--weight-bits", str(WEIGHT_BITS)])
    ranked = sorted(
        search.found.values(),
        key=lambda s: (
            s.quality.cost is None,
            s.quality.cost or 0.0,
            s.kv_cost is None,
            s.kv_cost or 0.0,
            -s.spare,
        ),
    )
    return ranked[:MAX_SUGGESTIONS]
