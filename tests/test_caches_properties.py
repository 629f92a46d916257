"""Property tests: random chunk/decode/trim sequences against a naive reference cache.

The test plays the model: keys are a unit 2-vector rotated by the cache's ``offset`` (one
RoPE frequency, so the key's angle encodes its position in the cache's frame) and values
carry a unique token id. From what ``update_and_fetch`` returns and the mask built by
``make_mask`` we read, for every query, which tokens it sees and at which distance. The
naive cache keeps the list of kept token ids; StreamingLLM distances are index gaps in it.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from mlxkv.caches.kivi import KiviKVCache
from mlxkv.caches.rotation import Rotation
from mlxkv.caches.streaming import QuantizedStreamingKVCache, StreamingKVCache
from mlxkv.memory import policy_bytes
from mlxkv.policy import KVPolicy

THETA = 1e-3  # radians per position: distances up to ~3000 read back unambiguously
ROT = Rotation(dims=2, traditional=False, base=10000.0, scale=THETA)


class NaiveCache:
    def __init__(self, sinks, window):
        self.S, self.W = sinks, window
        self.kept: list[int] = []  # token ids in order
        self.evicted = 0

    def push(self, uid):
        self.kept.append(uid)
        if self.W is not None and len(self.kept) > self.S + self.W:
            del self.kept[self.S]
            self.evicted += 1
        return list(self.kept)

    def trim(self, n):
        del self.kept[len(self.kept) - n :]


def _visible(mask, n_queries, n_keys):
    if mask is None:
        return np.ones((n_queries, n_keys), bool)
    if isinstance(mask, str):
        q = np.arange(n_keys - n_queries, n_keys)[:, None]
        return q >= np.arange(n_keys)[None]
    return np.broadcast_to(np.array(mask), (n_queries, n_keys))


def _step(cache, naive, n, uid0, frame):
    """Feed ``n`` tokens; check every query's visible tokens and distances."""
    P = cache.offset
    keys = ROT._rope(mx.broadcast_to(mx.array([1.0, 0.0]), (1, 1, n, 2)), P)
    uids = mx.arange(uid0, uid0 + n, dtype=mx.float32).reshape(1, 1, n, 1)
    mask = cache.make_mask(n)
    k, v = cache.update_and_fetch(keys, uids)
    k, v = np.array(k)[0, 0], np.array(v)[0, 0, :, 0]
    vis = _visible(mask, n, k.shape[0])
    for i in range(n):
        expect = naive.push(uid0 + i)
        qa = (P + i) * THETA
        q = np.array([math.cos(qa), math.sin(qa)])
        seen = {}
        for j in np.nonzero(vis[i])[0]:
            d = math.atan2(q[1] * k[j, 0] - q[0] * k[j, 1], q @ k[j]) / THETA
            seen[int(v[j])] = d
        assert sorted(seen) == sorted(expect), (i, sorted(seen), expect)
        for r, uid in enumerate(expect):  # StreamingLLM: distance = gap within the cache
            assert abs(seen[uid] - (len(expect) - 1 - r)) < 0.05, (uid, seen[uid], r)
    return uid0 + n


def _bytes(policy, cache, peak):
    n = peak if cache.evicted else cache.tokens_seen  # an evicting ring never shrinks
    return policy_bytes.allocated_bytes(policy, 1, 2, 1, 4, n, 1)


ops = hs.lists(
    hs.one_of(
        hs.integers(1, 20).map(lambda n: ("feed", n)),
        hs.just(("feed", 1)),
        hs.integers(1, 6).map(lambda n: ("trim", n)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sinks=hs.integers(0, 4),
    extra=hs.integers(1, 12),
    full=hs.booleans(),
    rebase=hs.integers(1, 8),
    ops=ops,
)
def test_kept_tokens_positions_and_masks(sinks, extra, full, rebase, ops):
    window = None if full else sinks + extra
    sinks = 0 if full else sinks
    cache = StreamingKVCache(window, sinks, ROT, rebase_every=rebase)
    policy = KVPolicy(window, sinks)
    naive = NaiveCache(sinks, window)
    uid, peak = 0, 0
    for op, n in ops:
        if op == "feed":
            uid = _step(cache, naive, n, uid, ROT)
            peak = max(peak, cache.tokens_seen)
        else:
            n = min(n, cache.trimmable())
            assert cache.trim(n) == n
            naive.trim(n)
        assert cache.kept == len(naive.kept)
        assert cache.evicted == naive.evicted
        assert cache.nbytes == _bytes(policy, cache, peak)
        if not any(o == "trim" for o, _ in ops):
            assert cache.kept == policy_bytes.kept_tokens(policy, cache.tokens_seen)
            assert cache.evicted == policy_bytes.evicted_tokens(policy, cache.tokens_seen)


@settings(max_examples=30, deadline=None)
@given(
    sinks=hs.integers(0, 4),
    extra=hs.integers(1, 300),
    bits=hs.sampled_from([2, 3, 4, 5, 6, 8]),
    group=hs.sampled_from([32, 64]),
    chunks=hs.lists(hs.integers(1, 300), min_size=1, max_size=8),
)
def test_quantized_counters_and_bytes(sinks, extra, bits, group, chunks):
    window = sinks + extra
    policy = KVPolicy(window, sinks, bits, group, key_scheme="rotated")
    cache = QuantizedStreamingKVCache(window, sinks, ROT, bits, group)
    seen = 0
    for n in chunks:
        x = mx.zeros((1, 2, n, 64))
        cache.update_and_fetch(x, x)
        seen += n
        assert cache.kept == policy_bytes.kept_tokens(policy, seen)
        assert cache.nbytes == policy_bytes.allocated_bytes(policy, 2, 64, 64, 4, seen, 1)


@settings(max_examples=30, deadline=None)
@given(
    sinks=hs.integers(0, 4),
    extra=hs.one_of(hs.none(), hs.integers(1, 300)),
    key_bits=hs.sampled_from([2, 3, 4, 5, 6, 8]),
    value_bits=hs.sampled_from([None, 2, 4, 8]),
    group=hs.sampled_from([32, 64, 128]),
    chunks=hs.lists(hs.integers(1, 300), min_size=1, max_size=8),
)
def test_kivi_counters_and_bytes(sinks, extra, key_bits, value_bits, group, chunks):
    """KIVI layout (transposed packed keys, per-channel scales, residual, whole-group ring):
    ``nbytes`` equals the memory model after every update, whatever the chunking."""
    window = None if extra is None else sinks + extra
    sinks = 0 if window is None else sinks
    policy = KVPolicy(
        window,
        sinks,
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=group,
        value_group_size=32,
    )
    cache = KiviKVCache.for_policy(policy, ROT)
    seen = 0
    for n in chunks:
        x = mx.zeros((1, 2, n, 64))
        cache.update_and_fetch(x, x)
        seen += n
        assert cache.kept == policy_bytes.kept_tokens(policy, seen)
        assert cache.nbytes == policy_bytes.allocated_bytes(policy, 2, 64, 64, 4, seen, 1)
