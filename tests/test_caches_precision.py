"""Float32 precision of positions far past any training length (rebasing)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from mlxkv.caches.rotation import Rotation
from mlxkv.caches.streaming import StreamingKVCache

# 0.9 rad per position: angles are inexact in float32, as real RoPE frequencies are
ROT = Rotation(dims=2, traditional=False, base=10000.0, scale=0.9)
S, W = 4, 1000


def _worst_distance_error(total: int, rebase_every: int | None) -> tuple[float, int]:
    cache = StreamingKVCache(W, S, ROT, rebase_every=rebase_every)
    unit = mx.array([1.0, 0.0])
    while cache.tokens_seen < total:  # the model's part: rotate new keys at ``offset``
        n = min(5000, total - cache.tokens_seen)
        keys = ROT._rope(mx.broadcast_to(unit, (1, 1, n, 2)), cache.offset)
        cache.update_and_fetch(keys, mx.zeros((1, 1, n, 1)))
        mx.eval(cache.keys, cache.sink_keys)
    P = cache.offset
    keys, _ = cache.update_and_fetch(ROT._rope(unit.reshape(1, 1, 1, 2), P), mx.zeros((1, 1, 1, 1)))
    keys = np.array(keys)[0, 0].astype(np.float64)
    q = np.array(ROT._rope(unit.reshape(1, 1, 1, 2), P))[0, 0, 0].astype(np.float64)
    t = cache.tokens_seen - 1
    worst = 0.0
    for slot in range(S + W):  # sinks sit right before the window; the window is true
        d = S + W - 1 - slot if slot < S else (t - S - (slot - S)) % W
        cos, sin = q @ keys[slot], q[1] * keys[slot, 0] - q[0] * keys[slot, 1]
        worst = max(worst, abs(cos - math.cos(0.9 * d)), abs(sin - math.sin(0.9 * d)))
    return worst, P


def test_rebase_keeps_positions_exact_at_a_million_tokens():
    err, frame = _worst_distance_error(1_000_000, None)
    assert frame <= S + W + 4096 + 1
    assert err < 1e-3
    err_no_rebase, frame = _worst_distance_error(1_000_000, 10**12)
    assert frame == 1_000_000 and err_no_rebase > 10 * err  # what rebasing buys
