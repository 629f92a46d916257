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
from mlxkv.caches.attention import grouped_queries, weighted_values
from mlxkv.caches.kivi import PIPELINE_KEYS, KiviKVCache
from mlxkv.caches.rows import (
    BatchRowCounters,
    pad_tokens,
    put_rows,
    put_young_sinks,
    sinks_at,
    stack_rows,
    take_rows,
    where_rows,
)


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


class BatchedKiviKVCache(BatchRowCounters):
    """B rows of one layer's KIVI cache (full, window or sink + window)."""

    keys = PIPELINE_KEYS  # the value store, for mlx-lm's pipeline send (see kivi.py)

    def __init__(self, like: KiviKVCache):
        super().__init__(like.window, like.sinks)
        self.rotation = like.rotation
        self.rebase_every = like.rebase_every
        self.kstore = like.kstore
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
        S = self.sinks
        ring, residual = self.kstore.zeros(rows, k, C)
        values = self.vstore.zeros(mx.broadcast_to(v, (rows, *v.shape[1:])), S + C)
        sinks = mx.zeros((rows, k.shape[1], S, k.shape[3]), k.dtype) if S else None
        return ring, residual, values, sinks

    def _alloc_rows(self, rows: int) -> None:
        C = self.kstore.slots(max(self.n[:rows], default=0))
        self.ring, self.residual, self.values, self.sink_keys = self._zeros(rows, C)

    def _fit(self, state, C: int):
        """One row's buffers padded to ``C`` ring slots."""
        if state is None:
            return self._zeros(1, C)
        ring, residual, values, sinks = state
        if ring is None:
            ring, residual = self.kstore.zeros(1, self._shapes[0], C)
        else:
            ring = self.kstore.fit(ring, C)
        return ring, residual, pad_tokens(values, self.sinks + C), sinks

    def _append(self, rows: list) -> None:
        C = self.kstore.slots(max(self.n))
        mine = self._fit((self.ring, self.residual, self.values, self.sink_keys), C)
        parts = [mine] + [self._fit(r, C) for r in rows]
        self.ring = stack_rows([p[0] for p in parts])
        self.residual = mx.concatenate([p[1] for p in parts], axis=0)
        self.values = stack_rows([p[2] for p in parts])
        if self.sinks:
            self.sink_keys = mx.concatenate([p[3] for p in parts], axis=0)

    def row(self, i: int) -> KiviKVCache:
        """Row ``i`` as its single KIVI cache: its ring cut to the slots it would hold alone."""
        state = dict(self._like, ring=None, residual=None, values=None, sink_keys=None)
        state.update(tokens_seen=self.n[i], evicted=self.evicted[i], base=self.base[i])
        if self.n[i] and self.values is not None:
            C = self.kstore.slots(self.n[i])
            idx = mx.array([i])
            if C:
                state["ring"] = st.own(self.kstore.fit(take_rows(self.ring, idx), C))
            state["residual"] = st.own(self.residual[i : i + 1])
            state["values"] = st.own(pad_tokens(take_rows(self.values, idx), self.sinks + C))
            if self.sink_keys is not None:
                state["sink_keys"] = st.own(self.sink_keys[i : i + 1])
        c = KiviKVCache.__new__(KiviKVCache)
        c.state = state
        return c

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep``; the ring shrinks to what the longest one left needs."""
        self.keep_rows(keep)
        if self.values is None:
            return
        if not keep:
            self.ring = self.residual = self.values = self.sink_keys = None
            return
        idx = mx.array(keep)
        C = self.kstore.slots(max(self.n))
        state = (
            take_rows(self.ring, idx),
            self.residual[idx],
            take_rows(self.values, idx),
            None if self.sink_keys is None else self.sink_keys[idx],
        )
        self.ring, self.residual, self.values, self.sink_keys = self._fit(state, C)

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
        oldest = [self.sinks + e for e in self.evicted_next()]
        mask = self.kstore.decode_mask(self.n, oldest, self.kstore.slots(max(self.n) + 1))
        return mask[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] != 1:
            raise ValueError("a batched cache takes decode steps only; prefill rows alone")
        S, G = self.sinks, self.kstore.group_size
        if self._shapes is None:
            self._shapes = (mx.zeros_like(keys[:1]), mx.zeros_like(values[:1]))
        if self.values is None:
            self._alloc_rows(len(self.n))
        C = self.kstore.slots(max(self.n) + 1)
        if self.kstore.held(self.ring) < C:
            self.ring, self.residual, self.values, self.sink_keys = self._fit(
                (self.ring, self.residual, self.values, self.sink_keys), C
            )
        ts = list(self.n)
        # each row's token: its value slot, and its index in the residual group
        self.values = put_rows(
            self.values,
            [t if t < S else S + self.kstore.pos(t - S) for t in ts],
            self.vstore.encode(values),
        )
        put = put_rows(self.residual, [0 if t < S else (t - S) % G for t in ts], keys)
        self.residual = where_rows([t >= S for t in ts], put, self.residual)
        if S:
            self.sink_keys = put_young_sinks(self.sink_keys, ts, keys)
        done = [b for b, t in enumerate(ts) if t >= S and (t - S) % G == G - 1]
        if done:  # a row's group is complete: quantize it from that row's residual alone
            q = self.kstore.encode(self.residual)
            for b in done:
                group = (ts[b] - S) // G
                self.kstore.write_groups(self.ring, group, q, 1, row=b)
        self.advance(ts)
        sinks = None
        if S:
            shifts = [e - b for e, b in zip(self.evicted, self.base, strict=True)]
            sinks = sinks_at(self.rotation, self.sink_keys, shifts)
        self._step = (ts, self.residual, sinks)  # this step's frame, before a rebase
        out = self.ring, self.values
        self._maybe_rebase()
        return out

    def _maybe_rebase(self) -> None:
        shifts = self.rebase_due()
        if shifts is None:
            return
        self.ring, self.residual = self.kstore.rebase(
            self.rotation, self.ring, self.residual, shifts
        )
        self.base = [e if d else b for e, b, d in zip(self.evicted, self.base, shifts, strict=True)]
        self._offset = None

    # ---- attention ----
    def attend(self, queries, keys, values, scale: float, mask, sinks=None) -> mx.array:
        if sinks is not None:
            raise ValueError("quantized KV caches do not support learned attention sinks")
        ts, residual, sink_keys = self._step
        S, G = self.sinks, self.kstore.group_size
        B = queries.shape[0]
        q, rep = grouped_queries(queries, scale, residual.shape[1])
        parts = []
        if S:
            parts.append(q @ sink_keys.swapaxes(-1, -2))
        C = self.kstore.held(keys)
        if C:
            s_ring, s_res = self.kstore.scores(q, keys, residual)
            # each row's group being filled: columns [j, j + i] take the residual's scores
            j = [self.kstore.pos(t - S) // G * G if t >= S else -G for t in ts]
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
