"""The row logic and the KIVI key store on their own: per-row rotations equal each row
rotated alone, the rebase schedule, and the key store's ring (wrapping writes, reads,
rebase) against the keys quantized directly."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.caches.kivi_keys import KiviKeyStore
from mlxkv.caches.rotation import Identity, Rotation
from mlxkv.caches.rows import (
    evicted_after,
    pad_tokens,
    put_young_sinks,
    rebase_shifts,
    sinks_at,
)

ROT = Rotation(64, False, 10000.0, 1.0)


def _keys(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def _equal(a, b) -> bool:
    return bool(mx.array_equal(a, b).item())


def test_per_row_shifts_equal_each_row_shifted_alone():
    x = _keys((3, 2, 4, 64), 0)
    shifts = [0, 3, 4103]
    got = ROT.shift_rows(x, shifts)
    for b, d in enumerate(shifts):
        assert _equal(got[b : b + 1], ROT.shift(x[b : b + 1], d)), d


def test_sinks_stay_as_rotated_without_a_shift_or_a_rope():
    x = _keys((2, 2, 4, 64), 1)
    assert sinks_at(ROT, x, [0, 0]) is x
    assert sinks_at(Identity(), x, [5, 7]) is x
    assert not _equal(sinks_at(ROT, x, [0, 5]), x)


def test_rebase_schedule():
    # rows rebase once `every` evictions have passed since their last rebase
    assert rebase_shifts(ROT, 60, 8, [7, 8, 20], [0, 0, 10]) == [0, -8, -10]
    assert rebase_shifts(ROT, 60, 8, [7, 9], [0, 2]) is None
    assert rebase_shifts(Identity(), 60, 8, [100], [0]) is None  # no positions in the keys
    assert rebase_shifts(ROT, None, 8, [100], [0]) is None  # a full cache never evicts
    assert [evicted_after(t, 4, 28, 0) for t in (30, 31, 32, 40)] == [0, 0, 1, 9]


def test_young_sinks_take_only_their_own_token():
    sinks = mx.zeros((3, 1, 4, 2))
    keys = mx.ones((3, 1, 1, 2))
    got = put_young_sinks(sinks, [0, 2, 9], keys)
    assert got[0, 0, :, 0].tolist() == [1, 0, 0, 0]
    assert got[1, 0, :, 0].tolist() == [0, 0, 1, 0]
    assert got[2, 0, :, 0].tolist() == [0, 0, 0, 0]  # token 9 is no sink


def test_pad_and_cut_along_tokens():
    x = _keys((1, 2, 5, 3), 2)
    padded = pad_tokens((x, x), 8)
    assert padded[0].shape == (1, 2, 8, 3) and _equal(padded[1][:, :, :5], x)
    assert float(mx.abs(padded[0][:, :, 5:]).sum()) == 0
    assert _equal(pad_tokens(x, 2), x[:, :, :2])


@pytest.mark.parametrize("bits", [4, 8])
def test_a_window_ring_wraps_and_reads_back_the_newest_groups(bits):
    G, W = 32, 80  # a window of 80 keeps 96 ring slots: 3 groups
    store = KiviKeyStore(bits, G, W, sinks=4)
    assert store.limit == 96 and store.slots(4 + 400) == 96
    keys = _keys((1, 2, 5 * G, 64), 3)  # 5 groups: the first two are overwritten
    ring, _ = store.zeros(1, keys, 96)
    store.write_groups(ring, 0, store.encode(keys), 5)
    want = store.decode(store.encode(keys))
    pieces = store.ring_keys(ring, 2 * G + 5, 5 * G)  # wraps: slots 69..95, then 0..63
    assert len(pieces) == 2
    assert _equal(mx.concatenate(pieces, axis=2), want[:, :, 2 * G + 5 :])


def test_rebase_rotates_only_the_rows_that_rebase():
    G = 32
    store = KiviKeyStore(4, G, 80, sinks=0)
    keys = _keys((2, 2, 96, 64), 4)
    ring = store.encode(keys)
    residual = _keys((2, 2, G, 64), 5)
    new_ring, new_res = store.rebase(ROT, ring, residual, [0, -37])
    for a, b in zip(new_ring, ring, strict=True):
        assert _equal(a[:1], b[:1])  # row 0 is not due: bit for bit
    moved = store.encode(ROT.shift(store.decode(tuple(x[1:] for x in ring)), -37))
    for a, b in zip(new_ring, moved, strict=True):
        assert _equal(a[1:], b)
    assert _equal(new_res[:1], residual[:1])
    assert _equal(new_res[1:], ROT.shift(residual[1:], -37))
