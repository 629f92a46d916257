"""Incremental KV prediction: the engine calls ``advance(n)`` once per model call.

Layers with identical caches are grouped, so a step costs O(distinct cache kinds) (2-4
for real models), never O(layers) or O(tokens). ``prefill(tokens, chunk)`` answers a whole
chunked prefill without walking it: the caches mlx-lm builds reach a state that repeats up
to a shift every few chunks, so one period is replayed and the rest is a translation.

Growing layers (plain KVCache) follow the user's policy through
``mlxkv.memory.policy_bytes`` (the caches' own arithmetic); every cache the model builds
for itself (sliding windows, chunked attention, SSM and linear-attention states) follows
mlx-lm's growth rules in ``native``.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass

from mlxkv.memory import native, policy_bytes
from mlxkv.memory.dtypes import dtype_bytes
from mlxkv.memory.layout import CacheSpec, Layout
from mlxkv.policy import KVPolicy

DEFAULT_POLICY = KVPolicy()


@dataclass(frozen=True)
class KVBytes:
    """KV cache bytes after ``tokens_seen`` tokens (all layers, whole batch)."""

    tokens_seen: int
    logical: int  # tokens kept x bytes per token, plus fixed states
    allocated: int  # what MLX holds: sum of the caches' nbytes
    peak_allocated: int  # largest ``allocated`` so far (rotating buffers shrink after a chunk)
    kept_tokens: int  # tokens a policy-governed layer keeps (tokens_seen if there is none)
    evicted_tokens: int


class _NativeGroup:
    """``count`` identical mlx-lm caches, replayed with a ``native`` tracker."""

    def __init__(self, spec: CacheSpec, count: int, batch: int, kv_dtype: str, tracker):
        self.tracker = tracker
        scale = count * batch
        self.token_bytes = spec.bytes_per_token(kv_dtype) * scale
        self.fixed_bytes = spec.state_bytes(kv_dtype) * scale

    def update(self, n: int) -> None:
        self.tracker.update(n)

    def logical(self) -> int:
        return self.tracker.logical * (self.token_bytes or self.fixed_bytes)

    def allocated(self) -> int:
        return self.tracker.length * (self.token_bytes or self.fixed_bytes)

    def kept(self) -> int | None:
        return None

    def decode_scratch(self, undo: int = 0) -> int:
        return 0

    def clone(self) -> _NativeGroup:
        c = copy.copy(self)
        c.tracker = copy.copy(self.tracker)
        return c

    def key(self) -> tuple:
        return self.tracker.key()

    def skip(self, tokens: int, n: int) -> None:
        self.tracker.shift(tokens)


class _PolicyGroup:
    """``count`` growing layers under a policy, sized by the caches' own policy_bytes."""

    def __init__(self, spec: CacheSpec, count: int, batch: int, kv_dtype: str, policy, pb):
        self.pb, self.policy, self.count = pb, policy, count
        self.shape = (spec.kv_heads, spec.k_head_dim, spec.v_head_dim, spec.elem_bytes(kv_dtype))
        self.batch = batch
        self.seen = 0

    def update(self, n: int) -> None:
        self.seen += n

    def logical(self) -> int:
        h, k, v, b = self.shape
        return self.count * self.pb.logical_bytes(self.policy, h, k, v, b, self.seen, self.batch)

    def allocated(self) -> int:
        h, k, v, b = self.shape
        return self.count * self.pb.allocated_bytes(self.policy, h, k, v, b, self.seen, self.batch)

    def kept(self) -> int | None:
        return self.pb.kept_tokens(self.policy, self.seen)

    def decode_scratch(self, undo: int = 0) -> int:
        h, k, v, b = self.shape
        sinks = self.pb.decode_scratch_bytes(self.policy, h, k, b)
        return self.count * (sinks + self.pb.undo_log_bytes(self.policy, undo, h, k, v, b))

    def clone(self) -> _PolicyGroup:
        return copy.copy(self)  # plain ints; policy and policy_bytes are shared read-only

    def key(self) -> tuple:
        return ()  # closed form in tokens seen: never part of a period

    def skip(self, tokens: int, n: int) -> None:
        self.seen += tokens


def _tracker(spec: CacheSpec, policy: KVPolicy):
    if spec.cls == "ArraysCache":
        return native.StateTracker()
    if spec.cls == "RotatingKVCache":
        return native.RotatingTracker(spec.window, spec.keep)
    if spec.cls == "ChunkedKVCache":
        return native.ChunkedTracker(spec.window)
    if spec.cls in ("KVCache", "QuantizedKVCache"):
        if policy.window is not None:  # mlx-lm's own way to bound a cache (no policy_bytes)
            return native.RotatingTracker(policy.window + policy.sinks, policy.sinks)
        return native.KVTracker()
    return native.NoneTracker()


def _group(spec: CacheSpec, count: int, batch: int, kv_dtype: str, policy, runtime: str):
    """The one place that decides who sizes a cache: policy_bytes or mlx-lm's rules."""
    if spec.grows:
        pb = policy_bytes if runtime == "mlxkv" else None
        if pb is not None:
            return _PolicyGroup(spec, count, batch, kv_dtype, policy, pb)
        if policy.bits is not None:  # mlx-lm's QuantizedKVCache
            spec = CacheSpec(
                "QuantizedKVCache",
                spec.role,
                spec.kv_heads,
                spec.k_head_dim,
                spec.v_head_dim,
                spec.dtype,
                bits=policy.bits,
                group_size=policy.group_size,
            )
    return _NativeGroup(spec, count, batch, kv_dtype, _tracker(spec, policy))


class KVPredictor:
    """Predicts KV bytes as tokens go through; ``advance(n)`` per model call of n tokens.

    ``advance`` must be called with exactly the token counts the model sees per call
    (a chunk of the prompt, then 1 per decoded token): allocation depends on the chunking.

    ``runtime``: "mlxkv" for caches from ``mlxkv.caches.make_caches`` (growing layers
    sized by policy_bytes), "mlx-lm" for mlx-lm's own ``make_prompt_cache`` caches
    (a window becomes a RotatingKVCache keeping the sinks, bits a QuantizedKVCache).
    """

    def __init__(
        self,
        layout: Layout,
        policy: KVPolicy | None = None,
        batch: int = 1,
        kv_dtype: str = "float32",
        runtime: str = "mlxkv",
    ):
        if runtime not in ("mlxkv", "mlx-lm"):
            raise ValueError(f"runtime must be 'mlxkv' or 'mlx-lm', got {runtime!r}")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        dtype_bytes(kv_dtype)
        self.layout, self.batch, self.kv_dtype = layout, batch, kv_dtype
        self.policy = policy or DEFAULT_POLICY
        counts = Counter(layout.specs())
        self._groups = [
            _group(spec, n, batch, kv_dtype, self.policy, runtime) for spec, n in counts.items()
        ]
        self.tokens_seen = 0
        self._peak = 0

    def advance(self, n_tokens: int) -> KVBytes:
        if n_tokens < 1:
            raise ValueError(f"a model call has at least 1 token, got {n_tokens}")
        for g in self._groups:
            g.update(n_tokens)
        self.tokens_seen += n_tokens
        snap = self.snapshot()
        return snap

    def snapshot(self) -> KVBytes:
        allocated = sum(g.allocated() for g in self._groups)
        self._peak = max(self._peak, allocated)
        kept = [k for g in self._groups if (k := g.kept()) is not None]
        kept_tokens = min(kept) if kept else self._bounded_kept()
        return KVBytes(
            tokens_seen=self.tokens_seen,
            logical=sum(g.logical() for g in self._groups),
            allocated=allocated,
            peak_allocated=self._peak,
            kept_tokens=kept_tokens,
            evicted_tokens=self.tokens_seen - kept_tokens,
        )

    def decode_scratch(self, undo: int = 0) -> int:
        """Bytes one decoding sequence holds beside its caches: its sinks rotated for the
        next steps (``policy_bytes.decode_scratch_bytes``) and, for caches built with an
        undo log of ``undo`` tokens, that log at its longest (``undo_log_bytes``). Batched
        caches hold none."""
        return 0 if self.batch > 1 else sum(g.decode_scratch(undo) for g in self._groups)

    def _bounded_kept(self) -> int:
        p = self.policy
        if p.window is None:
            return self.tokens_seen
        return min(self.tokens_seen, p.window + p.sinks)

    def prefill(self, tokens: int, chunk: int) -> KVBytes:
        """Advance through a prefill of ``tokens`` in ``chunk``-sized calls (the remainder
        last), exactly as ``advance`` per call would, in time independent of ``tokens``."""
        if chunk < 1:
            raise ValueError("chunk must be at least 1")
        full, rest = divmod(tokens, chunk)
        self._repeat(chunk, full)
        if rest:
            self.advance(rest)
        return self.snapshot()

    def _repeat(self, n: int, times: int) -> None:
        """``times`` calls of ``n`` tokens. Once the joint state of the mlx-lm caches repeats
        (equal ``key``), whole periods are skipped by translation, leaving one full period to
        replay: every value there is at least the skipped one it translates (buffers only
        grow with the shift, policy layers grow with tokens), so the peak stays exact."""
        seen: dict[tuple, int] = {}
        step, jumped = 0, False
        while step < times:
            if not jumped:
                key = tuple(g.key() for g in self._groups)
                first = seen.setdefault(key, step)
                if first != step:
                    jumped = True
                    period = step - first
                    skip = ((times - step) // period - 1) * period
                    if skip > 0:
                        for g in self._groups:
                            g.skip(skip * n, n)
                        self.tokens_seen += skip * n
                        step += skip
            self.advance(n)
            step += 1

    def copy(self) -> KVPredictor:
        """An independent predictor at the same point (to look ahead without disturbing it)."""
        c = copy.copy(self)
        c._groups = [g.clone() for g in self._groups]
        return c


def prefill_schedule(tokens: int, chunk: int) -> list[int]:
    """Model calls of a chunked prefill: ``chunk``-sized calls, the remainder last."""
    if chunk < 1:
        raise ValueError("chunk must be at least 1")
    full, rest = divmod(tokens, chunk)
    return [chunk] * full + ([rest] if rest else [])


def predict(
    layout: Layout,
    tokens: int,
    policy: KVPolicy | None = None,
    batch: int = 1,
    kv_dtype: str = "float32",
    chunk: int = 512,
    runtime: str = "mlxkv",
) -> KVBytes:
    """KV bytes after prefilling ``tokens`` in ``chunk``-sized model calls."""
    p = KVPredictor(layout, policy, batch, kv_dtype, runtime)
    p.snapshot()
    return p.prefill(tokens, chunk)


def batch_allocated(
    layout: Layout, policy: KVPolicy | None, rows_seen: list[int], kv_dtype: str = "float32"
) -> int:
    """KV bytes of mlxkv's batched decode caches for rows that have seen ``rows_seen`` tokens.

    Every row is padded to the slots of the longest one, so this is the batch-``B``
    allocation at ``max(rows_seen)`` tokens (exact for policy-governed layers, whose
    allocation depends only on the tokens seen, not on the chunking).
    """
    if not rows_seen or max(rows_seen) == 0:
        return 0
    p = KVPredictor(layout, policy, len(rows_seen), kv_dtype)
    return p.advance(max(rows_seen)).allocated
