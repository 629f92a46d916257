"""The row logic every sink + window cache shares, single-sequence (one row) or batched.

A row is one sequence: ``n`` tokens seen, ``evicted`` dropped from the window, ``base``
positions rebased away. What follows from those counters is computed here, once, for the
float, quantized and KIVI layouts alike:

* how many tokens a row has evicted once token ``t`` is in (:func:`evicted_after`), which
  is also the shift its sink keys need;
* the sink keys of each row rotated for its shift (:func:`sinks_at`), and a young row's
  token written into the sink copy (:func:`put_young_sinks`);
* which rows rebase now, and by how much (:func:`rebase_shifts`);
* the per-row array operations a batch needs (stack, take, pad, put one token per row,
  select per row), for plain arrays and quantized triples alike.

How a layout stores its keys (a ring of slots, or KIVI's groups) is the layout's own; when
it rebases, it rotates its keys by the shifts :func:`rebase_shifts` gives.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.caches.rotation import Rotation, ShiftsAhead


def evicted_after(t: int, sinks: int, window: int | None, before: int) -> int:
    """Tokens a sink + window row has evicted once token ``t`` is in (never fewer than
    ``before``, its count so far): also the shift its sink keys need."""
    if window is None:
        return 0
    return max(before, t + 1 - sinks - window)


def rebase_shifts(
    rotation, window: int | None, every: int | None, evicted: list[int], base: list[int]
) -> list[int] | None:
    """Per row, the shift that moves its keys into its new frame (minus the evictions since
    its last rebase, for rows that have let ``every`` pass; 0 for the others), or None when
    no row rebases now. Only RoPE keys carry positions, and only a window evicts."""
    if not isinstance(rotation, Rotation) or window is None:
        return None
    shifts = [-(e - b) if e - b >= every else 0 for e, b in zip(evicted, base, strict=True)]
    return shifts if any(shifts) else None


def sinks_at(rotation, sink_keys: mx.array, shifts: list[int], ahead: ShiftsAhead | None = None):
    """Each row's sink keys (kept as the model rotated them, at positions 0..S-1) moved
    forward by its shift: they sit right before the oldest kept window token. A one-row
    cache that decodes passes ``ahead`` (the next shifts rotated together)."""
    if not isinstance(rotation, Rotation) or not any(shifts):
        return sink_keys
    if ahead is not None and len(shifts) == 1:
        return ahead.get(rotation, sink_keys, shifts[0])
    return rotation.shift_rows(sink_keys, shifts)


def put_young_sinks(sink_keys: mx.array, ts: list[int], keys: mx.array) -> mx.array:
    """Write each row's new key (one token per row, at token index ``ts[b]``) into its sink
    copy where that token is a sink (``ts[b] < S``): sinks keep their original rotation."""
    S = sink_keys.shape[2]
    if all(t >= S for t in ts):
        return sink_keys
    young = mx.array([t < S for t in ts]).reshape(-1, 1, 1, 1)
    idx = mx.array([min(t, S - 1) for t in ts]).reshape(-1, 1, 1, 1)
    return mx.where(young, mx.put_along_axis(sink_keys, idx, keys, axis=2), sink_keys)


# ---- arrays of rows: plain arrays or quantized triples, rows on axis 0 ----
def _each(s, f):
    return tuple(f(x) for x in s) if isinstance(s, (tuple, list)) else f(s)


def stack_rows(parts: list):
    """Concatenate stored tensors along the batch axis."""
    if isinstance(parts[0], (tuple, list)):
        return tuple(mx.concatenate(list(p), axis=0) for p in zip(*parts, strict=True))
    return mx.concatenate(parts, axis=0)


def take_rows(s, idx: mx.array):
    return _each(s, lambda x: x[idx])


def pad_axis(s, n: int, axis: int):
    """Zero-pad (or cut) a stored tensor along ``axis`` to ``n``."""

    def pad(x):
        have = x.shape[axis]
        if have >= n:
            return x if have == n else x[(slice(None),) * axis + (slice(0, n),)]
        shape = list(x.shape)
        shape[axis] = n - have
        return mx.concatenate([x, mx.zeros(shape, x.dtype)], axis=axis)

    return _each(s, pad)


def pad_tokens(s, n: int):
    """Zero-pad (or cut) along the token axis (2) to ``n`` slots."""
    return pad_axis(s, n, 2)


def put_rows(s, slots: list[int], v):
    """Write one token per row: row ``b`` of ``v`` goes to token slot ``slots[b]``."""
    idx = mx.array(slots).reshape(-1, 1, 1, 1)
    if isinstance(s, tuple):
        return tuple(mx.put_along_axis(x, idx, y, axis=2) for x, y in zip(s, v, strict=True))
    return mx.put_along_axis(s, idx, v, axis=2)


def where_rows(rows: list[bool], a, b):
    """Row ``i`` of ``a`` where ``rows[i]``, else of ``b``."""
    m = mx.array(rows).reshape(-1, 1, 1, 1)
    if isinstance(a, tuple):
        return tuple(mx.where(m, x, y) for x, y in zip(a, b, strict=True))
    return mx.where(m, a, b)


class BatchRowCounters:
    """Rows of a batched sink + window cache: ``n`` tokens seen, ``evicted`` dropped and
    ``base`` positions rebased away, per row. Whoever changes ``n`` or ``base`` sets
    ``_offset`` to None (the array is built once per step, when a model asks)."""

    window: int | None
    sinks: int
    rotation: object  # the layer's Rotation (or Identity / None), set by the cache
    rebase_every: int

    def __init__(self, window: int | None, sinks: int):
        self.window, self.sinks = window, sinks
        self.n: list[int] = []
        self.evicted: list[int] = []
        self.base: list[int] = []
        self._offset = None

    @property
    def limit(self) -> int | None:
        return None if self.window is None else self.sinks + self.window

    @property
    def offset(self) -> mx.array:
        if self._offset is None:
            self._offset = mx.array([n - b for n, b in zip(self.n, self.base, strict=True)])
        return self._offset

    @property
    def batch_size(self) -> int:
        return len(self.n)

    def evicted_next(self) -> list[int]:
        """Each row's evicted count once its next token is in."""
        return [
            evicted_after(n, self.sinks, self.window, e)
            for n, e in zip(self.n, self.evicted, strict=True)
        ]

    def advance(self, ts: list[int]) -> None:
        """Each row's token ``ts[b]`` is in: count it and what it evicted."""
        for b, t in enumerate(ts):
            self.evicted[b] = evicted_after(t, self.sinks, self.window, self.evicted[b])
            self.n[b] = t + 1
        self._offset = None

    def rebase_due(self) -> list[int] | None:
        """Per row, the shift of its keys if it rebases now (see :func:`rebase_shifts`)."""
        return rebase_shifts(self.rotation, self.window, self.rebase_every, self.evicted, self.base)

    def keep_rows(self, keep: list[int]) -> None:
        self.n = [self.n[i] for i in keep]
        self.evicted = [self.evicted[i] for i in keep]
        self.base = [self.base[i] for i in keep]
        self._offset = None
