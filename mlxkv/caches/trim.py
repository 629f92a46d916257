"""Rewinding caches by n tokens, exactly (regenerate an answer, reuse a prompt cache).

What each cache can give back:

* full caches (``FullKVCache``, quantized full, mlx-lm ``KVCache``): any number of tokens;
* sink/window caches: everything before the first eviction; afterwards only what their
  undo log covers (``reserve`` tokens since the last prefill chunk, none by default): a
  token that left the window cannot come back, and a trim must leave what an uncached run
  would hold;
* mlx-lm ``RotatingKVCache``: what it accepts before it wraps (``offset < max_size``);
* recurrent states (SSM, linear attention, ``ArraysCache``): nothing.

``trim_caches`` trims all layers by the same amount or none at all.
"""

from __future__ import annotations

from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from mlxkv.caches.errors import CacheError


def trimmable(cache) -> int:
    """How many tokens can be removed from the end of ``cache``."""
    if hasattr(cache, "trimmable"):
        return cache.trimmable()
    if isinstance(cache, CacheList):
        return min(trimmable(c) for c in cache.caches)
    if isinstance(cache, RotatingKVCache):
        return cache.offset if cache.is_trimmable() else 0
    if isinstance(cache, KVCache) or (cache.is_trimmable() and hasattr(cache, "offset")):
        return cache.offset
    return 0


def trimmable_after(caches: list, n: int) -> int:
    """How many tokens every cache of ``caches`` can remove exactly once an update of ``n``
    tokens is in (speculative decoding asks before it feeds its drafts); 0: none."""
    most = None
    for cache in caches:
        if hasattr(cache, "trimmable_after"):
            k = cache.trimmable_after(n)
        elif isinstance(cache, CacheList):
            k = trimmable_after(cache.caches, n)
        elif isinstance(cache, RotatingKVCache):  # exact until it wraps
            k = cache.offset + n if cache.offset + n < cache.max_size else 0
        elif isinstance(cache, KVCache | QuantizedKVCache):
            k = cache.offset + n
        else:
            k = 0  # a recurrent state cannot be rewound
        most = k if most is None else min(most, k)
    return most or 0


def _why(cache) -> str:
    if hasattr(cache, "trimmable") and getattr(cache, "evicted", 0):
        return "the sliding window has already evicted older tokens"
    if isinstance(cache, RotatingKVCache):
        return "mlx-lm's rotating cache has wrapped"
    if not cache.is_trimmable():
        return f"{type(cache).__name__} (a recurrent state) cannot be rewound"
    return "fewer tokens are cached"


def trim_caches(caches: list, n: int) -> int:
    """Remove the last ``n`` tokens from every cache, or raise :class:`CacheError`."""
    if n < 0:
        raise CacheError(f"cannot rewind a negative number of tokens ({n})")
    if n == 0 or not caches:
        return 0
    worst = min(range(len(caches)), key=lambda i: trimmable(caches[i]))
    most = trimmable(caches[worst])
    if n > most:
        raise CacheError(
            f"cannot rewind {n} tokens, at most {most}: {_why(caches[worst])} (layer {worst})"
        )
    for c in caches:
        c.trim(n)
    return n
