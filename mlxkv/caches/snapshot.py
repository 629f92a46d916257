"""Copies of cache states, to go back to a point a trim cannot reach exactly.

A full cache trims exactly to any length. A window or sink cache that has evicted cannot
bring back what it dropped, and recurrent states (SSM, linear attention) cannot be rewound
at all; for those the engine keeps a copy of every cache's ``state`` at a turn boundary
and restores it. A copy costs at most one cache's worth of memory: MLX arrays are shared
until the live cache writes into them.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxkv.caches.streaming import StreamingKVCache


def _copy(state):
    # A distinct array object: the live cache writes into its own arrays in place.
    return tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, state)


def always_exact(cache) -> bool:
    """True when trimming ``cache`` by any number of tokens is always exact."""
    if isinstance(cache, StreamingKVCache):
        return cache.window is None
    return isinstance(cache, (KVCache, QuantizedKVCache))


def snapshot(caches: list) -> list:
    """The states of ``caches``, copied."""
    return [_copy(c.state) for c in caches]


def restore(caches: list, states: list) -> None:
    """Put ``caches`` back to a :func:`snapshot` (in place; the snapshot stays reusable)."""
    for c, s in zip(caches, states, strict=True):
        c.state = _copy(s)


def copy_caches(caches: list) -> list:
    """Independent copies of caches (a shared prefix handed to a new row): each copy is
    rebuilt from a copy of the state, so no array, store or log is shared with the original
    (arrays are copied lazily, on the first write)."""
    out = []
    for c in caches:
        d = copy.copy(c)
        d.state = _copy(c.state)
        out.append(d)
    return out
