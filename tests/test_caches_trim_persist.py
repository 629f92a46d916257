"""Trim / rewind and save / load round trips, and their refusals."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from mlxkv.caches import CacheError, load_caches, make_caches, save_caches, trim_caches
from mlxkv.caches import storage as st
from mlxkv.memory import policy_bytes as pb
from mlxkv.policy import KVPolicy
from tests._caches_ref import feed, gpu_rule
from tests.tiny_models import build, tiny_llama

POLICIES = [
    KVPolicy(),
    KVPolicy(bits=4, group_size=32),
    KVPolicy(window=20),
    KVPolicy(window=20, sinks=4),
    KVPolicy(window=20, sinks=4, bits=8, group_size=32),
    KVPolicy(window=20, sinks=4, bits=8, group_size=32, key_scheme="rotated"),
]
IDS = [p.describe() for p in POLICIES]
# an undo log (``reserve``) needs per-token keys: KIVI caches rewind only their residual
UNDO = [p for p in POLICIES[2:] if p.key_bits is None or p.key_scheme != "kivi"]
A = [(5 * i + 1) % 64 for i in range(80)]
B = [(11 * i + 7) % 64 for i in range(80)]


@pytest.fixture(scope="module", params=["float32", "gpu"])
def model(request):
    """The tiny llama in float32 and under the GPU rule (bfloat16, packed 4-bit)."""
    return tiny_llama(layers=2) if request.param == "float32" else gpu_rule(tiny_llama(layers=2))


def _b(model) -> int:
    """Bytes per KV element: the activation dtype's."""
    return model.model.norm.weight.dtype.size


def _tol(model, fp32: float) -> float:
    """A trimmed cache against an uncached run over the same tokens in other chunks: the
    same arithmetic in another order. float32 agrees to ``fp32``; bfloat16 (8 bits of
    mantissa) rounds each order's sums differently: by up to 0.125 on these logits
    (magnitude about 5) in every policy here; allowed 0.25."""
    return fp32 if _b(model) == 4 else 0.25


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_trim_before_eviction_is_exact(model, policy):
    window_room = policy.kept_tokens or 80
    n = min(22, window_room - 2)
    caches = make_caches(model, policy)
    feed(model, A[:n], caches, [n - 3, 1, 1, 1])
    assert trim_caches(caches, 8) == 8
    assert caches[0].kept == n - 8
    got = feed(model, B[:6], caches, [4, 1, 1])
    fresh = feed(model, A[: n - 8] + B[:6], make_caches(model, policy), [n - 8 + 4, 1, 1])
    assert mx.abs(got - fresh[:, n - 8 :]).max().item() < _tol(model, 2e-5)
    assert caches[0].nbytes == pb.allocated_bytes(policy, 2, 32, 32, _b(model), n - 8 + 6)


def test_trim_shrinks_allocation(model):
    caches = make_caches(model, KVPolicy())
    feed(model, A + B + A + B, caches, [300, 1, 19])
    trim_caches(caches, 100)
    assert caches[0].nbytes == pb.allocated_bytes(KVPolicy(), 2, 32, 32, _b(model), 220)


@pytest.mark.parametrize("policy", POLICIES[2:], ids=IDS[2:])
def test_trim_after_eviction_refused_without_reserve(model, policy):
    caches = make_caches(model, policy)
    feed(model, A[:60], caches, [30] + [1] * 30)
    assert caches[0].evicted == 60 - policy.kept_tokens
    assert not caches[0].is_trimmable()
    with pytest.raises(CacheError, match="at most 0: the sliding window has already evicted"):
        trim_caches(caches, 1)
    assert caches[0].kept == policy.kept_tokens and caches[0].tokens_seen == 60


@pytest.mark.parametrize("policy", UNDO, ids=[p.describe() for p in UNDO])
@pytest.mark.parametrize("cut", [1, 3, 5, 6])
def test_trim_after_eviction_within_reserve_is_exact(model, policy, cut):
    """Trims inside the undo log leave the cache as an uncached run over the rest: same
    logits afterwards, same counters, same bytes. (Float caches rebase often here, and the
    undo log follows; quantized ones do not: a rebase re-quantizes, and an uncached run
    rebases at other token counts.)"""
    rebase = None if policy.bits else 7
    caches = make_caches(model, policy, reserve=6, rebase_every=rebase)
    feed(model, A[:60], caches, [30, 1, 1, 4, 2, 1] + [1] * 21)
    assert caches[0].trimmable() >= 6
    assert trim_caches(caches, cut) == cut
    fresh = make_caches(model, policy, rebase_every=rebase)
    feed(model, A[: 60 - cut], fresh, [60 - cut])
    for c, f in zip(caches, fresh, strict=True):
        assert (c.kept, c.evicted, c.tokens_seen, c.nbytes) == (
            f.kept,
            f.evicted,
            f.tokens_seen,
            f.nbytes,
        )
    got = feed(model, B[:6], caches, [4, 1, 1])
    want = feed(model, B[:6], fresh, [4, 1, 1])
    assert mx.abs(got - want).max().item() < _tol(model, 2e-4)


@pytest.mark.parametrize("policy", UNDO, ids=[p.describe() for p in UNDO])
def test_the_undo_log_skips_prefill_chunks_and_holds_at_most_its_predicted_bytes(model, policy):
    """An evicting prefill chunk clears the undo log (no rejected draft reaches into it:
    recorded, it held the chunk's input and the slots it overwrote). Draft steps and the
    single steps after them fill it to ``undo_log_bytes`` at most: exactly that after a
    longest step (``reserve`` drafts and the token before them) and ``reserve`` - 1
    single steps; any mix of steps and trims stays within it."""
    reserve = 3
    caches = make_caches(model, policy, reserve=reserve)
    bound = pb.undo_log_bytes(policy, reserve, 2, 32, 32, _b(model))
    feed(model, A[:40], caches, [40])  # past the window
    assert caches[0].evicted > 0
    assert [c.undo_nbytes for c in caches] == [0, 0] and caches[0].trimmable() == 0
    feed(model, A[40:46], caches, [reserve + 1] + [1] * (reserve - 1))
    assert [c.undo_nbytes for c in caches] == [bound, bound]
    worst = 0
    for step, back in [(4, 3), (1, 0), (2, 1), (4, 0), (1, 0), (1, 0), (3, 2), (1, 0), (4, 2)]:
        feed(model, B[:step], caches, [step])
        trim_caches(caches, back)
        worst = max(worst, *(c.undo_nbytes for c in caches))
    assert 0 < worst <= bound


def test_trim_refusals():
    ssm = make_caches(build("mamba"), KVPolicy())
    with pytest.raises(CacheError, match="recurrent state"):
        trim_caches(ssm, 1)
    assert trim_caches(ssm, 0) == 0
    with pytest.raises(CacheError, match="negative"):
        trim_caches(ssm, -1)
    model = tiny_llama(layers=1)
    rot = [RotatingKVCache(8, keep=2)]
    feed(model, A[:12], rot, [1] * 12)
    with pytest.raises(CacheError, match="wrapped"):
        trim_caches(rot, 1)


META = {"model": "tiny-llama", "policy": None, "dtype": "float32"}


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_save_load_round_trip(model, policy, tmp_path):
    meta = dict(META, policy=policy.to_dict())
    caches = make_caches(model, policy, rebase_every=10)
    feed(model, A[:50], caches, [40] + [1] * 10)
    path = tmp_path / "c.safetensors"
    save_caches(path, caches, meta)
    loaded = load_caches(path, meta)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert loaded[0].kept == caches[0].kept and loaded[0].offset == caches[0].offset
    assert loaded[0].nbytes == caches[0].nbytes
    a = feed(model, B[:12], caches, [5, 1, 1, 5])
    b = feed(model, B[:12], loaded, [5, 1, 1, 5])
    assert mx.array_equal(a, b)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_file_keeps_the_slots_of_the_tokens_not_the_whole_step(model, policy, tmp_path):
    """Before its first eviction a cache holds its tokens from slot 0 of a 256-slot step
    (or of its window): its file keeps those tokens' slots, KIVI keys the residual rows in
    use and the ring's groups up to the one being filled (a short conversation's file was
    up to 6x larger than its tokens). It reads back into the whole step: the same bytes in
    memory, the same logits after it."""
    import json
    import struct

    n, S, G = (13 if policy.window else 50), policy.sinks, policy.group_size
    meta = dict(META, policy=policy.to_dict())
    caches = make_caches(model, policy)
    feed(model, A[:n], caches, [n - 3, 1, 1, 1])
    assert caches[0].evicted == 0
    path = tmp_path / "c.safetensors"
    save_caches(path, caches, meta)
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    slots = {}  # token slots of each kind of buffer, over all layers
    for name, t in header.items():
        part = name.split(".")[1:2]
        if part and len(t["shape"]) == 4 and part[0] != "key_offset":
            if part[0] == "ring":  # K^T: packed words, or one scale / bias per group
                per = 32 // policy.key_bits if name.endswith("ring.0") else G
                slots.setdefault("ring", set()).add(t["shape"][3] * per)
            else:
                slots.setdefault(part[0], set()).add(t["shape"][2])
    if policy.key_bits and policy.key_scheme == "kivi":
        assert slots == {
            "values": {n},
            "residual": {(n - S) % G},
            "ring": {st.round_up(n - S, G)},
            **({"sink_keys": {S}} if S else {}),
        }
    else:
        buffers = {"0", "1"} if policy.window is None and not policy.bits else {"keys", "values"}
        assert slots == {**dict.fromkeys(buffers, {n}), **({"sink_keys": {S}} if S else {})}
    loaded = load_caches(path, meta)
    assert [c.nbytes for c in loaded] == [c.nbytes for c in caches]
    a = feed(model, B[:12], caches, [5, 1, 1, 5])
    b = feed(model, B[:12], loaded, [5, 1, 1, 5])
    assert mx.array_equal(a, b)


@pytest.mark.parametrize("name", ["lfm2", "llama_sliding"])
def test_save_load_models_own_caches(name, tmp_path):
    model = build(name)
    policy = KVPolicy(window=10, sinks=2)
    caches = make_caches(model, policy)
    feed(model, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], caches, [12, 1])
    save_caches(tmp_path / "c.safetensors", caches, META)
    loaded = load_caches(tmp_path / "c.safetensors", META)
    a = feed(model, [4, 5, 6], caches, [2, 1])
    b = feed(model, [4, 5, 6], loaded, [2, 1])
    assert mx.array_equal(a, b)


def test_save_load_empty(model, tmp_path):
    caches = make_caches(model, KVPolicy(window=20, sinks=4))
    save_caches(tmp_path / "e.safetensors", caches, META)
    loaded = load_caches(tmp_path / "e.safetensors", META)
    assert loaded[0].empty() and loaded[0].sinks == 4


@pytest.mark.parametrize(
    "key, other",
    [
        ("model", "another-model"),
        ("policy", KVPolicy(window=21, sinks=4).to_dict()),
        ("dtype", "bfloat16"),
    ],
)
def test_load_refuses_other_model_policy_dtype(model, tmp_path, key, other):
    meta = dict(META, policy=KVPolicy(window=20, sinks=4).to_dict())
    caches = make_caches(model, KVPolicy(window=20, sinks=4))
    feed(model, A[:5], caches, [5])
    save_caches(tmp_path / "c.safetensors", caches, meta)
    with pytest.raises(CacheError, match=f"made with {key}=") as err:
        load_caches(tmp_path / "c.safetensors", dict(meta, **{key: other}))
    assert "\n" not in str(err.value)


def test_load_refuses_foreign_files(tmp_path):
    with pytest.raises(CacheError, match="no saved cache"):
        load_caches(tmp_path / "missing.safetensors", META)
    mx.save_safetensors(str(tmp_path / "w.safetensors"), {"w": mx.zeros(3)})
    with pytest.raises(CacheError, match="not an mlxkv cache"):
        load_caches(tmp_path / "w.safetensors", META)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CacheError, match="not a readable cache"):
        load_caches(tmp_path / "junk.safetensors", META)


def _arrays(tree) -> list:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def _rope():
    from mlxkv.caches.rotation import Rotation

    return Rotation(64, False, 100000.0, 1.0)


def _sink_cache():
    from mlxkv.caches import StreamingKVCache

    return StreamingKVCache(16, sinks=4, rotation=_rope())


def _kivi_cache():
    from mlxkv.caches import KiviKVCache

    return KiviKVCache(16, sinks=4, rotation=_rope(), key_bits=4, group_size=32)


def _rotated_cache():
    from mlxkv.caches import QuantizedStreamingKVCache

    return QuantizedStreamingKVCache(16, sinks=4, rotation=_rope(), bits=4, group_size=32)


@pytest.mark.parametrize("make", [_sink_cache, _kivi_cache, _rotated_cache])
def test_a_copy_shares_nothing_with_its_original(make):
    """A shared prefix is copied into each row: writes to the original must not reach the
    copy, whatever the cache keeps besides its arrays (stores, undo log)."""
    import numpy as np

    from mlxkv.caches import copy_caches
    from tests.kv_rows import prefill_random, random_kv

    original = prefill_random(make(), 40, seed=1, heads=2)
    (copy,) = copy_caches([original])
    before = [np.array(x) for x in _arrays(copy.state)]
    k, v = random_kv(9, seed=5, heads=2)
    original.update_and_fetch(k, v)
    mx.eval(_arrays(original.state))
    assert copy.tokens_seen == 40 and original.tokens_seen == 49
    after = [np.array(x) for x in _arrays(copy.state)]
    assert len(before) == len(after) > 0
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, b)
    for name in ("_undo", "kstore", "vstore"):
        if hasattr(original, name):
            assert getattr(copy, name) is not getattr(original, name)
