"""Random keys and values for cache tests, and a cache prefilled with them in chunks."""

from __future__ import annotations

import mlx.core as mx


def random_kv(n: int, seed: int, heads: int, dim: int = 64):
    """(keys, values) of shape (1, heads, n, dim), reproducible from ``seed``."""
    k = mx.random.normal((1, heads, n, dim), key=mx.random.key(seed))
    v = mx.random.normal((1, heads, n, dim), key=mx.random.key(seed + 1000))
    return k, v


def prefill_random(cache, n: int, seed: int, heads: int, dim: int = 64, chunk: int = 7):
    """Feed ``cache`` n random tokens, ``chunk`` at a time (crossing group and window
    boundaries mid-chunk); returns the cache."""
    k, v = random_kv(n, seed, heads, dim)
    for a in range(0, n, chunk):
        cache.update_and_fetch(k[..., a : a + chunk, :], v[..., a : a + chunk, :])
    return cache
