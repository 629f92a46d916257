"""The per-row counters every batched cache keeps, and what mlx-lm's models read of them."""

from __future__ import annotations

import mlx.core as mx


class BatchRowCounters:
    """Rows of a batched sink + window cache: ``n`` tokens seen, ``evicted`` dropped and
    ``base`` positions rebased away, per row. Whoever changes ``n`` or ``base`` sets
    ``_offset`` to None (the array is built once per step, when a model asks)."""

    window: int | None
    sinks: int

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
