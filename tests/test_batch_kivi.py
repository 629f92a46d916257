"""Batched KIVI caches against their single-sequence forms: rows at different positions
(groups completing at different steps, one row still filling its sinks), leaving and
joining, must attend exactly as each row's own single cache, hold its buffers bit for bit,
and allocate what the memory model predicts."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.caches import cache_for, copy_caches
from mlxkv.caches.batched import BatchedKVCache, batched_form
from mlxkv.caches.batched_kivi import BatchedKiviKVCache
from mlxkv.caches.rotation import Rotation
from mlxkv.memory import policy_bytes
from mlxkv.policy import KVPolicy
from tests.kv_rows import prefill_random, random_kv

H, D = 2, 64
ROT = Rotation(D, False, 100000.0, 1.0)
POLICIES = [
    KVPolicy(bits=4, group_size=32),
    KVPolicy(window=40, sinks=4, bits=4, group_size=32),
    KVPolicy(window=30, key_bits=3, value_bits=2, group_size=32),
    KVPolicy(window=40, sinks=4, key_bits=4, group_size=32),  # values unquantized
]


def _single(policy, rebase_every=None):
    return cache_for(policy, ROT, rebase_every=rebase_every)


def _kv(n, seed):
    return random_kv(n, seed, H, D)


def _prefill(c, n, seed):
    return prefill_random(c, n, seed, H, D)


def _rows_equal(batched, singles):
    """Each row's buffers, cut to its single cache's size, equal the single cache's."""
    for b, s in enumerate(singles):
        if s.values is None:
            continue
        C = s.ring[1].shape[-1] if s.ring is not None else 0
        if C:
            words = s.ring[0].shape[-1]
            got = (
                batched.ring[0][b : b + 1, ..., :words],
                batched.ring[1][b : b + 1, ..., :C],
                batched.ring[2][b : b + 1, ..., :C],
            )
            assert all(mx.array_equal(x, y).item() for x, y in zip(got, s.ring, strict=True))
            assert mx.array_equal(batched.residual[b : b + 1], s.residual).item()
        vals = s.values if isinstance(s.values, tuple) else (s.values,)
        bvals = batched.values if isinstance(batched.values, tuple) else (batched.values,)
        for x, y in zip(bvals, vals, strict=True):
            assert mx.array_equal(x[b : b + 1, :, : y.shape[2]], y).item(), f"row {b} values"


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe())
def test_rows_attend_like_their_single_caches(policy):
    """Rows at 3, 23, 40 and 70 tokens, decode steps across group boundaries and evictions,
    a row leaving, a prefilled row and an empty row joining; rebases every 16 evictions."""
    singles = [_prefill(_single(policy, 16), n, i) for i, n in enumerate([3, 23, 40, 70])]
    assert batched_form(singles) is None
    batched = BatchedKVCache.merge(copy_caches(singles))
    assert isinstance(batched, BatchedKiviKVCache)
    seed = 100
    for step in range(45):
        if step == 12:  # row 1 finishes
            del singles[1]
            batched.filter([0, 2, 3])
        if step == 20:  # a long prompt joins, and a one-token one (nothing prefilled)
            joining = [_prefill(_single(policy, 16), 37, 7), _single(policy, 16)]
            singles += joining
            batched.extend_rows(copy_caches(joining))
        ks, vs = zip(*(_kv(1, seed + b) for b in range(len(singles))), strict=True)
        q = mx.random.normal((len(singles), 2 * H, 1, D), key=mx.random.key(seed + 7))
        seed += 10
        mask = batched.make_mask(1)
        k_out, v_out = batched.update_and_fetch(mx.concatenate(ks), mx.concatenate(vs))
        out = batched.attend(q, k_out, v_out, scale=0.125, mask=mask)
        for b, (s, k, v) in enumerate(zip(singles, ks, vs, strict=True)):
            m = s.make_mask(1)
            sk, sv = s.update_and_fetch(k, v)
            ref = s.attend(q[b : b + 1], sk, sv, scale=0.125, mask=m)
            assert mx.abs(out[b : b + 1] - ref).max().item() < 1e-5, (step, b)
        _rows_equal(batched, singles)
        assert batched.n == [s.tokens_seen for s in singles]
        assert batched.offset.tolist() == [s.offset for s in singles]
    if policy.window is not None:  # evictions and rebases happened on the way
        assert any(batched.evicted) and any(batched.base)


@pytest.mark.parametrize("policy", POLICIES[:2], ids=lambda p: p.describe())
def test_batched_bytes_equal_the_prediction(policy):
    singles = [_prefill(_single(policy), n, i) for i, n in enumerate([3, 300, 41])]
    batched = BatchedKVCache.merge(copy_caches(singles))
    for _ in range(40):
        k, v = _kv(3, 5)
        batched.update_and_fetch(k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3))
        want = policy_bytes.allocated_bytes(policy, H, D, D, 4, max(batched.n), batch=3)
        assert batched.nbytes == want
    batched.filter([0, 2])
    assert batched.nbytes == policy_bytes.allocated_bytes(
        policy, H, D, D, 4, max(batched.n), batch=2
    )


def test_a_pipeline_send_tied_to_the_batched_cache_keeps_its_buffers():
    """mlx-lm's pipeline rebinds ``cache.keys`` through ``mx.depends`` (a list back): the
    batched KIVI cache keeps its value triple and every row's buffers."""
    policy = POLICIES[1]
    singles = [_prefill(_single(policy), n, i) for i, n in enumerate([3, 50])]
    batched = BatchedKVCache.merge(copy_caches(singles))
    batched.keys = mx.depends(batched.keys, mx.ones((2, 1, 8)))
    assert isinstance(batched.values, tuple)
    _rows_equal(batched, singles)
