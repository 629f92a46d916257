"""Batched decoding form of :class:`~mlxkv.caches.kivi.KiviKVCache`: B rows of one layer.

The same contract as :mod:`mlxkv.caches.batched`: rows are prefilled alone in their single
KIVI caches, join with :meth:`BatchedKiviKVCache.merge` / :meth:`extend_rows`, leave with
:meth:`filter`, and decode one token per row per step. Every row keeps its single cache's
layout (sink keys, ring of key groups ``K^T``, residual, value slots), zero-padded to the
batch's ring capacity, and its own counters (tokens seen, evicted, base): nothing is
left-padded, so no padding ever enters a group's scale or bias. A row's group is quantized
when that row's last token of the group arrives, from that row's residual alone. So every
row attends to exactly what its single cache would give it.

Allocation: the ring slots of the longest row for every row (``kivi_ring_slots(max n)``),
so ``policy_bytes.allocated_bytes`` with ``tokens_seen = max_b n[b]`` and ``batch = B``.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.caches import storage as st
from mlxkv.caches.batch_rows import BatchRowCounters
from mlxkv.caches.kivi import (
    KiviKVCache,
    dequantize_groups,
    grouped_queries,
    packed_scores,
    quantize_groups,
    sink_scores,
    weighted_values,
)
from mlxkv.caches.rotation import Rotation
from mlxkv.caches.streaming import evicted_after
from mlxkv.memory.policy_bytes import kivi_ring_limit, kivi_ring_slots


def _pad_last(x: mx.array, n: int) -> mx.array:
    """Zero-pad (or cut) the last axis to ``n``."""
    have = x.shape[-1]
    if have == n:
        return x
    if have > n:
        return x[..., :n]
    return mx.concatenate([x, mx.zeros((*x.shape[:-1], n - have), x.dtype)], axis=-1)


def _pad_tokens(s, n: int):
    """Zero-pad a value store (array or triple, tokens on axis 2) to ``n`` slots."""

    def pad(x):
        have = x.shape[2]
        if have >= n:
            return x[:, :, :n]
        return mx.concatenate([x, mx.zeros((*x.shape[:2], n - have, x.shape[3]), x.dtype)], 2)

    return tuple(pad(x) for x in s) if isinstance(s, (tuple, list)) else pad(s)


def _cat_rows(parts: list):
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate(list(p), axis=0) for p in zip(*parts, strict=True))
    return mx.concatenate(parts, axis=0)


def _row_state(c: KiviKVCache):
    """A single cache's buffers (None: it holds nothing yet); files give lists back."""
    if c.values is None:
        return None
    ring = None if c.ring is None else tuple(c.ring)
    values = tuple(c.values) if isinstance(c.values, list) else c.values
    return ring, c.residual, values, c.sink_keys


def _shapes_of(c: KiviKVCache):
    """(1, H, 1, D) zeros standing for a single cache's keys and values."""
    keys = c.sink_keys if c.sink_keys is not None else c.residual
    H, D = keys.shape[1], keys.shape[-1]
    if isinstance(c.values, (tuple, list)):
        packed, scales = c.values[0], c.values[1]
        dv, vdt = packed.shape[-1] * 32 // c.vstore.bits, scales.dtype
    else:
        dv, vdt = c.values.shape[-1], c.values.dtype
    return mx.zeros((1, H, 1, D), keys.dtype), mx.zeros((1, H, 1, dv), vdt)


def _is_buffer(v) -> bool:
    return isinstance(v, mx.array | tuple | list)


def _take_rows(s, idx: mx.array):
    return tuple(x[idx] for x in s) if isinstance(s, tuple) else s[idx]


class BatchedKiviKVCache(BatchRowCounters):
    """B rows of one layer's KIVI cache (full, window or sink + window)."""

    def __init__(self, like: KiviKVCache):
        super().__init__(like.window, like.sinks)
        self.rotation = like.rotation
        self.rebase_every = like.rebase_every
        self.key_bits, self.group_size = like.key_bits, like.group_size
        self.vstore = like.vstore.empty_like()
        self.ring = self.residual = self.values = self.sink_keys = None
        self._shapes = None  # (B=1, H, 1, D) keys and values standing for the rows' shapes
        self._step = None
        self._like = {k: v for k, v in like.state.items() if not _is_buffer(v)}

    # ---- building from single caches ----
    @classmethod
    def merge(cls, caches: list[KiviKVCache]) -> BatchedKiviKVCache:
        out = cls(caches[0])
        out.extend_rows(caches)
        return out

    def extend_rows(self, caches: list[KiviKVCache]) -> None:
        """Append single caches as new rows (a waiting prompt joins the batch)."""
        old = len(self.n)
        for c in caches:
            self.n.append(c._n)
            self.evicted.append(c._evicted)
            self.base.append(c._base)
        self._offset = None
        if self._shapes is None:
            like = next((c for c in caches if c.values is not None), None)
            if like is None:
                return  # nothing held yet: buffers come with the first update
            self._shapes = _shapes_of(like)
        if self.values is None:
            self._alloc_rows(old)
        self._append([_row_state(c) for c in caches])

    def _zeros(self, rows: int, C: int):
        """Buffers of ``rows`` empty rows with ``C`` ring slots."""
        k, v = self._shapes
        H, D, dt = k.shape[1], k.shape[3], k.dtype
        G, b, S = self.group_size, self.key_bits, self.sinks
        ring = (
            mx.zeros((rows, H, D, C * b // 32), mx.uint32),
            mx.zeros((rows, H, D, C // G), dt),
            mx.zeros((rows, H, D, C // G), dt),
        )
        residual = mx.zeros((rows, H, G, D), dt)
        values = self.vstore.zeros(mx.broadcast_to(v, (rows, *v.shape[1:])), S + C)
        sinks = mx.zeros((rows, H, S, D), dt) if S else None
        return ring, residual, values, sinks

    def _alloc_rows(self, rows: int) -> None:
        C = self._ring_slots(max(self.n[:rows], default=0))
        self.ring, self.residual, self.values, self.sink_keys = self._zeros(rows, C)

    def _fit(self, state, C: int):
        """One row's buffers padded to ``C`` ring slots."""
        if state is None:
            return self._zeros(1, C)
        ring, residual, values, sinks = state
        G, b, S = self.group_size, self.key_bits, self.sinks
        if ring is None:
            z = self._zeros(1, C)
            ring, residual = z[0], z[1]
        else:
            ring = (
                _pad_last(ring[0], C * b // 32),
                _pad_last(ring[1], C // G),
                _pad_last(ring[2], C // G),
            )
        values = _pad_tokens(tuple(values) if isinstance(values, list) else values, S + C)
        return ring, residual, values, sinks

    def _append(self, rows: list) -> None:
        C = self._ring_slots(max(self.n))
        mine = self._fit((self.ring, self.residual, self.values, self.sink_keys), C)
        parts = [mine] + [self._fit(r, C) for r in rows]
        self.ring = _cat_rows([p[0] for p in parts])
        self.residual = mx.concatenate([p[1] for p in parts], axis=0)
        self.values = _cat_rows([p[2] for p in parts])
        if self.sinks:
            self.sink_keys = mx.concatenate([p[3] for p in parts], axis=0)

    def row(self, i: int) -> KiviKVCache:
        """Row ``i`` as its single KIVI cache: its ring cut to the slots it would hold alone."""
        state = dict(self._like, ring=None, residual=None, values=None, sink_keys=None)
        state.update(tokens_seen=self.n[i], evicted=self.evicted[i], base=self.base[i])
        if self.n[i] and self.values is not None:
            C = self._ring_slots(self.n[i])
            G, b, S = self.group_size, self.key_bits, self.sinks
            idx = mx.array([i])
            if C:
                packed, scales, biases = _take_rows(self.ring, idx)
                state["ring"] = (
                    _pad_last(packed, C * b // 32),
                    _pad_last(scales, C // G),
                    _pad_last(biases, C // G),
                )
            state["residual"] = self.residual[i : i + 1]
            state["values"] = _pad_tokens(_take_rows(self.values, idx), S + C)
            if self.sink_keys is not None:
                state["sink_keys"] = self.sink_keys[i : i + 1]
        c = KiviKVCache.__new__(KiviKVCache)
        c.state = state
        return c

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep``; the ring shrinks to what the longest one left needs."""
        self.n = [self.n[i] for i in keep]
        self.evicted = [self.evicted[i] for i in keep]
        self.base = [self.base[i] for i in keep]
        self._offset = None
        if self.values is None:
            return
        if not keep:
            self.ring = self.residual = self.values = self.sink_keys = None
            return
        idx = mx.array(keep)
        C = self._ring_slots(max(self.n))
        state = (
            _take_rows(self.ring, idx),
            self.residual[idx],
            _take_rows(self.values, idx),
            None if self.sink_keys is None else self.sink_keys[idx],
        )
        self.ring, self.residual, self.values, self.sink_keys = self._fit(state, C)

    # ---- arithmetic (per row, as the single cache) ----
    def _ring_slots(self, n: int) -> int:
        return kivi_ring_slots(n, self.sinks, self.window, self.group_size)

    def _pos(self, u: int) -> int:
        cmax = kivi_ring_limit(self.window, self.group_size)
        return u if cmax is None else u % cmax

    def _d(self, b: int, t: int) -> int:
        return evicted_after(t, self.sinks, self.window, self.evicted[b])

    def empty(self) -> bool:
        return self.values is None

    @property
    def nbytes(self) -> int:
        return st.nbytes(self.ring, self.residual, self.values, self.sink_keys)

    @property
    def state(self):
        return self.ring, self.residual, self.values, self.sink_keys

    # ---- the protocol ----
    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N != 1:
            raise ValueError("a batched cache takes decode steps only; prefill rows alone")
        if window_size is not None:
            raise ValueError("model-defined attention windows are not batched here")
        S = self.sinks
        C = self._ring_slots(max(self.n) + 1)
        t = mx.array(self.n)[:, None]
        parts = []
        if S:
            parts.append(mx.arange(S)[None] <= t)
        if C:
            r = mx.arange(C)[None]
            ut = t - S
            cmax = kivi_ring_limit(self.window, self.group_size)
            u = r if cmax is None else ut - ((ut - r) % cmax)
            oldest = S + mx.array([self._d(b, n) for b, n in enumerate(self.n)])[:, None]
            parts.append((u >= 0) & (u <= ut) & (S + u >= oldest))
        mask = mx.concatenate(parts, axis=1)
        return mask[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] != 1:
            raise ValueError("a batched cache takes decode steps only; prefill rows alone")
        S, G = self.sinks, self.group_size
        if self._shapes is None:
            self._shapes = (mx.zeros_like(keys[:1]), mx.zeros_like(values[:1]))
        if self.values is None:
            self._alloc_rows(len(self.n))
        C = self._ring_slots(max(self.n) + 1)
        if self.ring[1].shape[-1] * G < C:
            self.ring, self.residual, self.values, self.sink_keys = self._fit(
                (self.ring, self.residual, self.values, self.sink_keys), C
            )
        ts = list(self.n)
        # value slot, residual index of each row's token
        vslot = [t if t < S else S + self._pos(t - S) for t in ts]
        ridx = [0 if t < S else (t - S) % G for t in ts]
        enc = self.vstore.encode(values)
        idx = mx.array(vslot).reshape(-1, 1, 1, 1)
        if isinstance(self.values, tuple):
            self.values = tuple(
                mx.put_along_axis(x, idx, y, axis=2) for x, y in zip(self.values, enc, strict=True)
            )
        else:
            self.values = mx.put_along_axis(self.values, idx, enc, axis=2)
        ring_rows = mx.array([t >= S for t in ts]).reshape(-1, 1, 1, 1)
        put = mx.put_along_axis(self.residual, mx.array(ridx).reshape(-1, 1, 1, 1), keys, axis=2)
        self.residual = mx.where(ring_rows, put, self.residual)
        if S and any(t < S for t in ts):  # sink tokens keep their original rotation
            young = mx.array([t < S for t in ts]).reshape(-1, 1, 1, 1)
            sidx = mx.array([min(t, S - 1) for t in ts]).reshape(-1, 1, 1, 1)
            sput = mx.put_along_axis(self.sink_keys, sidx, keys, axis=2)
            self.sink_keys = mx.where(young, sput, self.sink_keys)
        done = [b for b, t in enumerate(ts) if t >= S and (t - S) % G == G - 1]
        if done:  # a row's group is complete: quantize it from that row's residual alone
            q = quantize_groups(self.residual, self.group_size, self.key_bits)
            words = G * self.key_bits // 32
            for b in done:
                s = self._pos(ts[b] - S) // G
                self.ring[0][b : b + 1, ..., s * words : (s + 1) * words] = q[0][b : b + 1]
                self.ring[1][b : b + 1, ..., s : s + 1] = q[1][b : b + 1]
                self.ring[2][b : b + 1, ..., s : s + 1] = q[2][b : b + 1]
        for b, t in enumerate(ts):
            self.evicted[b] = self._d(b, t)
            self.n[b] = t + 1
        sinks = self._shifted_sinks() if S else None
        self._step = (ts, self.residual, sinks)  # this step's frame, before a rebase
        out = self.ring, self.values
        self._maybe_rebase()
        self._offset = None
        return out

    def _shifted_sinks(self) -> mx.array:
        shifts = [e - b for e, b in zip(self.evicted, self.base, strict=True)]
        if not any(shifts) or not isinstance(self.rotation, Rotation):
            return self.sink_keys
        return self.rotation._rope(self.sink_keys[..., None, :], mx.array(shifts))[..., 0, :]

    def _maybe_rebase(self) -> None:
        if not isinstance(self.rotation, Rotation) or self.window is None:
            return
        due = [b for b in range(len(self.n)) if self.evicted[b] - self.base[b] >= self.rebase_every]
        if not due:
            return
        shifts = [0] * len(self.n)
        for b in due:
            shifts[b] = -(self.evicted[b] - self.base[b])
        sh = mx.array(shifts)
        rows = mx.array([s != 0 for s in shifts]).reshape(-1, 1, 1, 1)
        dense = dequantize_groups(self.ring, self.group_size, self.key_bits)
        dense = self.rotation._rope(dense[..., None, :], sh)[..., 0, :]
        new = quantize_groups(dense, self.group_size, self.key_bits)
        self.ring = tuple(mx.where(rows, a, b) for a, b in zip(new, self.ring, strict=True))
        res = self.rotation._rope(self.residual[..., None, :], sh)[..., 0, :]
        self.residual = mx.where(rows, res, self.residual)
        for b in due:
            self.base[b] = self.evicted[b]

    # ---- attention ----
    def attend(self, queries, keys, values, scale: float, mask, sinks=None) -> mx.array:
        if sinks is not None:
            raise ValueError("quantized KV caches do not support learned attention sinks")
        ts, residual, sink_keys = self._step
        S, G = self.sinks, self.group_size
        B = queries.shape[0]
        q, rep = grouped_queries(queries, scale, residual.shape[1])
        parts = []
        if S:
            parts.append(sink_scores(q, rep, sink_keys))
        C = keys[1].shape[-1] * G
        if C:
            s_ring, s_res = packed_scores(q, rep, keys, residual, G, self.key_bits)
            # each row's group being filled: columns [j, j + i] take the residual's scores
            j = [self._pos(t - S) // G * G if t >= S else -G for t in ts]
            i = [(t - S) % G if t >= S else -1 for t in ts]
            cols = mx.arange(C)[None]
            start = mx.array(j)[:, None]
            use = (cols >= start) & (cols <= start + mx.array(i)[:, None])
            at = mx.clip(cols - start, 0, G - 1)
            shape = (B,) + (1,) * (s_ring.ndim - 2) + (C,)
            res_full = mx.take_along_axis(s_res, at.reshape(shape), axis=-1)
            s_ring = mx.where(use.reshape(shape), res_full, s_ring)
            parts.append(s_ring)
        scores = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        return weighted_values(scores, mask, rep, self.vstore, values, queries.shape[1])
