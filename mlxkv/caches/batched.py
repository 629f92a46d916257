"""Batched decoding form of the policy caches: one cache object per layer for B rows.

Rows are independent sequences that sit at different positions: row ``b`` has seen
``n[b]`` tokens, evicted ``evicted[b]`` and rebased by ``base[b]``, exactly the counters of
its own single-sequence :class:`~mlxkv.caches.streaming.StreamingKVCache` (or
:class:`~mlxkv.caches.full.FullKVCache`). Every row uses the single cache's slot layout
(sinks in ``[0, S)``, token ``k >= S`` in slot ``S + (k - S) % W``; token ``k`` in slot
``k`` for a full cache), so a row's buffer is the single cache's buffer, zero-padded to
the batch's capacity. Nothing is left-padded: positions are per row (``offset`` is an
array of B positions, which RoPE applies row by row) and the mask hides each row's unused
slots.

A row is prefilled alone in its single-sequence cache (chunked prefill is exact there) and
then joins with :meth:`BatchedKVCache.merge` / :meth:`extend`; finished rows leave with
:meth:`filter`, and :meth:`BatchedKVCache.row` gives a row back as the single cache it would
be had it decoded alone (the prefix cache keeps a finished answer's caches that way).
Updates here are decode steps (one token per row): each row writes its
token into its own slot, evicting rows re-rotate their sink keys by their own shift (one
RoPE call with per-row offsets, bitwise equal to the single cache's), and a row rebases on
the same schedule as alone. So every row attends to exactly the keys and values its single
cache would hold, in the same slots.

Allocation: ``capacity(max_b n[b], S + W)`` slots for every row (256-token steps, like the
single caches), plus the full-precision sink-key copy: ``policy_bytes.allocated_bytes``
with ``tokens_seen = max_b n[b]`` and ``batch = B``.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.caches import storage as st
from mlxkv.caches.attention import attention
from mlxkv.caches.batched_kivi import BatchedKiviKVCache
from mlxkv.caches.full import FullKVCache
from mlxkv.caches.kivi import KiviKVCache
from mlxkv.caches.rows import (
    BatchRowCounters,
    pad_tokens,
    put_rows,
    put_young_sinks,
    sinks_at,
    stack_rows,
    take_rows,
)
from mlxkv.caches.streaming import (
    DEFAULT_REBASE_EVERY,
    QuantizedStreamingKVCache,
    StreamingKVCache,
    rebase_ring,
)


class BatchedKVCache(BatchRowCounters):
    """B rows of one layer's policy cache (window/sink/full, float or quantized)."""

    def __init__(self, window, sinks, rotation, store, rebase_every=None, value_store=None):
        super().__init__(window, sinks)
        self.rotation = rotation
        self.kstore = store
        self.vstore = value_store or store
        self.rebase_every = rebase_every or DEFAULT_REBASE_EVERY
        self.keys = self.values = self.sink_keys = None
        self.sink_shift: list[int] = []
        self._no_offset: list[bool] = []  # rows whose key offset comes with their first token
        self._single = None  # (class, scalar state) of the single caches the rows came from

    # ---- building from single-sequence caches ----
    @classmethod
    def merge(cls, caches: list) -> BatchedKVCache:
        """One batched cache holding ``caches`` (single-sequence caches of one layer) as rows."""
        first = caches[0]
        if isinstance(first, KiviKVCache):
            return BatchedKiviKVCache.merge(caches)
        if isinstance(first, FullKVCache):
            out = BatchedKVCache(None, 0, None, st.FloatStore())
        elif isinstance(first, StreamingKVCache):
            out = cls._of(first)
        else:
            raise TypeError(f"{type(first).__name__} has no batched form")
        out._single = (type(first), None if isinstance(first, FullKVCache) else _scalars(first))
        out.extend_rows(caches)
        return out

    @staticmethod
    def _of(c: StreamingKVCache) -> BatchedKVCache:
        if isinstance(c, QuantizedStreamingKVCache):
            # fresh stores: the key offset is per row and is stacked as rows join
            k, v = c.kstore.empty_like(), c.vstore.empty_like()
            return QuantizedBatchedKVCache(c.window, c.sinks, c.rotation, k, c.rebase_every, v)
        return BatchedKVCache(c.window, c.sinks, c.rotation, st.FloatStore(), c.rebase_every)

    @staticmethod
    def _counters(c) -> tuple[int, int, int, int]:
        if isinstance(c, FullKVCache):
            return c.offset, 0, 0, 0
        return c._n, c._evicted, c._base, c._sink_shift

    def extend_rows(self, caches: list) -> None:
        """Append single-sequence caches as new rows (a waiting prompt joins the batch)."""
        for c in caches:
            n, e, b, d = self._counters(c)
            self.n.append(n)
            self.evicted.append(e)
            self.base.append(b)
            self.sink_shift.append(d)
        self._offset = None
        new_rows = [(c.keys, c.values, getattr(c, "sink_keys", None)) for c in caches]
        like = next((r for r in new_rows if r[0] is not None), None)
        if like is None and self.keys is None:
            return  # every row is still empty: buffers are made by the first update
        if self.keys is None:
            self._alloc_like(like, len(self.n) - len(caches))
        self._extend_offsets(caches)
        cap = self._capacity(max(self.n))
        parts_k, parts_v = [pad_tokens(self.keys, cap)], [pad_tokens(self.values, cap)]
        parts_s = []
        if self.sinks:
            parts_s.append(self.sink_keys)
        for k, v, s in new_rows:
            if k is None:
                k, v = self._zeros_rows(1, cap)
                s = self._zero_sinks(1)
            elif self.sinks and s is None:
                s = self._zero_sinks(1)
            parts_k.append(pad_tokens(k, cap))
            parts_v.append(pad_tokens(v, cap))
            if self.sinks:
                parts_s.append(s)
        self.keys, self.values = stack_rows(parts_k), stack_rows(parts_v)
        if self.sinks:
            self.sink_keys = mx.concatenate(parts_s, axis=0)

    def _extend_offsets(self, caches: list) -> None:
        """Stack the rows' key offsets (rotated key scheme). A row without one yet (nothing
        prefilled) takes its first token's key at its first update, as its single cache does."""
        if not isinstance(self.kstore, st.RotatedKeyStore):
            return
        k_like = self._shapes[0]
        zero = mx.zeros((1, k_like.shape[1], 1, k_like.shape[3]), k_like.dtype)
        old = len(self.n) - len(caches)
        if self.kstore.offset is None:
            parts, self._no_offset = [zero] * old, [True] * old
        else:
            parts = [self.kstore.offset]
            self._no_offset += [False] * (old - len(self._no_offset))
        for c in caches:
            have = c.kstore.offset is not None
            parts.append(c.kstore.offset if have else zero)
            self._no_offset.append(not have)
        self.kstore.offset = mx.concatenate(parts, axis=0)

    def _take_first_offsets(self, keys: mx.array) -> None:
        if not any(self._no_offset):
            return
        if self.kstore.offset is None:  # every row starts here: the store takes them all
            self._no_offset = [False] * len(self.n)
            return
        pending = mx.array(self._no_offset).reshape(-1, 1, 1, 1)
        self.kstore.offset = mx.where(pending, keys[..., :1, :], self.kstore.offset)
        self._no_offset = [False] * len(self.n)

    def _alloc_like(self, like, rows: int):
        k, v, _ = like
        self._shapes = (self._dense_like(k, self.kstore), self._dense_like(v, self.vstore))
        self.keys, self.values = self._zeros_rows(rows, 0)
        if self.sinks:
            self.sink_keys = self._zero_sinks(rows)

    def _dense_like(self, s, store):
        """A (1, H, 1, D) array in the activation dtype standing for stored tensor ``s``."""
        if isinstance(s, tuple):
            w, scales, _ = s
            D = w.shape[-1] * 32 // store.bits
            return mx.zeros((1, w.shape[1], 1, D), scales.dtype)
        return mx.zeros((1, s.shape[1], 1, s.shape[3]), s.dtype)

    def _zeros_rows(self, rows: int, cap: int):
        k_like, v_like = self._shapes
        k = self.kstore.zeros(mx.broadcast_to(k_like, (rows, *k_like.shape[1:])), cap)
        v = self.vstore.zeros(mx.broadcast_to(v_like, (rows, *v_like.shape[1:])), cap)
        return k, v

    def _zero_sinks(self, rows: int):
        k_like = self._shapes[0]
        return mx.zeros((rows, k_like.shape[1], self.sinks, k_like.shape[3]), k_like.dtype)

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished rows leave); capacity shrinks to what is left."""
        flags = self._no_offset + [False] * (len(self.n) - len(self._no_offset))
        self._no_offset = [flags[i] for i in keep] if self._no_offset else []
        self.keep_rows(keep)
        self.sink_shift = [self.sink_shift[i] for i in keep]
        if self.keys is None:
            return
        if not keep:
            self.keys = self.values = self.sink_keys = None
            self.kstore.offset = None
            return
        idx = mx.array(keep)
        if self.kstore.offset is not None:
            self.kstore.offset = self.kstore.offset[idx]
        cap = self._capacity(max(self.n))
        self.keys = pad_tokens(take_rows(self.keys, idx), cap)
        self.values = pad_tokens(take_rows(self.values, idx), cap)
        if self.sinks:
            self.sink_keys = self.sink_keys[idx]

    def row(self, i: int):
        """Row ``i`` as its single-sequence cache: the same slots, counters and allocation
        as if it had decoded alone (a row's buffer is that cache's, zero-padded)."""
        cls, scalars = self._single
        n = self.n[i]
        if cls is FullKVCache:
            c = FullKVCache()
            if n and self.keys is not None:
                c.keys = st.own(pad_tokens(self.keys[i : i + 1], st.round_up(n)))
                c.values = st.own(pad_tokens(self.values[i : i + 1], st.round_up(n)))
                c.offset = n
            return c
        state = dict(scalars)
        state.update(tokens_seen=n, evicted=self.evicted[i], base=self.base[i])
        state.update(sink_shift=self.sink_shift[i], keys=None, values=None, sink_keys=None)
        state["key_offset"] = None
        if n and self.keys is not None:
            idx = mx.array([i])
            cap = st.capacity(n, self.limit)
            state["keys"] = st.own(pad_tokens(take_rows(self.keys, idx), cap))
            state["values"] = st.own(pad_tokens(take_rows(self.values, idx), cap))
            if self.sinks:
                state["sink_keys"] = st.own(self.sink_keys[i : i + 1])
            if self.kstore.offset is not None and not self._row_waits_for_offset(i):
                state["key_offset"] = st.own(self.kstore.offset[i : i + 1])
        return cls.from_state(state)

    def _row_waits_for_offset(self, i: int) -> bool:
        return i < len(self._no_offset) and self._no_offset[i]

    # ---- the protocol mlx-lm models call ----
    def _capacity(self, tokens: int) -> int:
        return st.capacity(tokens, self.limit) if tokens > 0 else 0

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N != 1:
            raise ValueError("a batched cache takes decode steps only; prefill rows alone")
        if window_size is not None:
            raise ValueError("model-defined attention windows are not batched here")
        held = [self._held(n + 1) for n in self.n]
        width = max(held)  # slots past every row are left out (packed: masked in attend)
        if all(h == width for h in held):
            return None
        return (mx.arange(width)[None] < mx.array(held)[:, None])[:, None, None, :]

    def _held(self, n: int) -> int:
        return n if self.limit is None else min(n, self.limit)

    def _slot(self, t: int) -> int:
        if self.window is None or t < self.sinks:
            return t
        return self.sinks + (t - self.sinks) % self.window

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] != 1:
            raise ValueError("a batched cache takes decode steps only; prefill rows alone")
        S = self.sinks
        if self.keys is None:
            self._shapes = (mx.zeros_like(keys[:1]), mx.zeros_like(values[:1]))
            self.keys, self.values = self._zeros_rows(len(self.n), 0)
            if S:
                self.sink_keys = self._zero_sinks(len(self.n))
        cap = self._capacity(max(self.n) + 1)
        if st.tokens_of(self.keys) < cap:
            self.keys, self.values = pad_tokens(self.keys, cap), pad_tokens(self.values, cap)
        ts = list(self.n)
        slots = [self._slot(t) for t in ts]
        self._take_first_offsets(keys)
        self.keys = put_rows(self.keys, slots, self.kstore.encode(keys))
        self.values = put_rows(self.values, slots, self.vstore.encode(values))
        if S:
            self.sink_keys = put_young_sinks(self.sink_keys, ts, keys)
        self.advance(ts)
        self._set_sink_shifts()
        out = self._fetch()
        self._maybe_rebase()
        return out

    def _width(self) -> int:
        """Slots the widest row holds after an update (what a decoding step attends over)."""
        return max(self._held(n) for n in self.n)

    def _fetch(self):
        width = self._width()
        if width == st.tokens_of(self.keys):
            return self.keys, self.values
        return st.take(self.keys, 0, width), st.take(self.values, 0, width)

    def _set_sink_shifts(self):
        """Rows whose evicted count moved get their sink slots rewritten, rotated for it."""
        if not self.sinks:
            return
        want = [e - b for e, b in zip(self.evicted, self.base, strict=True)]
        if want == self.sink_shift:
            return
        changed = mx.array([w != d for w, d in zip(want, self.sink_shift, strict=True)])
        enc = self.kstore.encode(sinks_at(self.rotation, self.sink_keys, want))
        mask = changed.reshape(-1, 1, 1, 1)
        S = self.sinks
        bufs = self.keys if isinstance(self.keys, tuple) else (self.keys,)
        news = enc if isinstance(enc, tuple) else (enc,)
        for buf, new in zip(bufs, news, strict=True):  # in place: only S slots change
            buf[..., :S, :] = mx.where(mask, new, buf[..., :S, :])
        self.sink_shift = want

    def _maybe_rebase(self):
        shifts = self.rebase_due()
        if shifts is None:
            return
        self.keys = rebase_ring(
            self.keys, self.sink_keys, self.kstore, self.rotation, self.window, shifts
        )
        for b, d in enumerate(shifts):
            if d:
                self.base[b] = self.evicted[b]
                self.sink_shift[b] = 0
        self._offset = None

    # ---- accounting ----
    @property
    def nbytes(self) -> int:
        return st.nbytes(self.keys, self.values, self.sink_keys) + self.kstore.extra_nbytes()

    @property
    def state(self):
        return self.keys, self.values, self.sink_keys

    def empty(self) -> bool:
        return self.keys is None


class QuantizedBatchedKVCache(BatchedKVCache):
    """Rows stored quantized; decode steps attend on the packed stores (the same
    ``attend`` interface as the single-sequence quantized cache)."""

    held: int | None = None  # slots of the returned buffers that hold the widest row

    def _fetch(self):
        # The whole buffers, the slots past the widest row masked in ``attend``: MLX's CUDA
        # quantized kernels take no sliced operand.
        self.held = self._width()
        return self.keys, self.values

    def attend(self, queries, keys, values, scale: float, mask, sinks=None) -> mx.array:
        if sinks is not None:
            raise ValueError("quantized KV caches do not support learned attention sinks")
        q = self.kstore.queries(queries)
        return attention(q, keys, values, scale, mask, self.kstore, self.vstore, self.held)


def batched_form(caches: list) -> str | None:
    """None if these single-sequence caches (one model's layers) can be batched, else why."""
    kinds = sorted(
        {
            type(c).__name__
            for c in caches
            if not isinstance(c, (FullKVCache, StreamingKVCache, KiviKVCache))
        }
    )
    if kinds:
        return f"{', '.join(kinds)} caches have no batched form"
    return None


def merge_rows(rows: list[list]) -> list[BatchedKVCache]:
    """Per-layer batched caches from per-row lists of single-sequence caches."""
    return [BatchedKVCache.merge([r[i] for r in rows]) for i in range(len(rows[0]))]


def split_row(caches: list, i: int) -> list:
    """Row ``i`` of per-layer batched caches, as the single-sequence caches it decoded like."""
    return [c.row(i) for c in caches]


def _scalars(c: StreamingKVCache) -> dict:
    """A single cache's state without its arrays (what every row of a batch shares)."""
    return {k: v for k, v in c.state.items() if not isinstance(v, mx.array | tuple | list)}
