"""Quantized KV schemes: the cache's own attention against a reference that dequantizes the
whole store and attends densely; save/load of the schemes; files from before separate key
and value stores."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from mlxkv.caches import CacheError, load_caches, make_caches, save_caches
from mlxkv.caches import attention as attention_module
from mlxkv.caches.attention import attention
from mlxkv.caches.batched import merge_rows
from mlxkv.caches.storage import QuantStore, RotatedKeyStore
from mlxkv.caches.streaming import StreamingKVCache
from mlxkv.policy import KVPolicy
from tests._caches_ref import feed
from tests.tiny_models import tiny_llama

# the per-token key schemes (KIVI keys have their own tests: test_caches_kivi.py)
ROT = dict(key_scheme="rotated")
SCHEMES = [
    dict(bits=4, group_size=32, **ROT),
    dict(bits=4, group_size=32, key_scheme="plain"),
    dict(key_bits=4, value_bits=2, group_size=32, **ROT),
    dict(key_bits=3, value_bits=8, group_size=64, value_group_size=32, **ROT),
    dict(key_bits=4, group_size=32, **ROT),
    dict(value_bits=4, group_size=32),
]
SHAPES = [dict(), dict(window=24), dict(window=20, sinks=4)]
CASES = [KVPolicy(**shape, **q) for shape in SHAPES for q in SCHEMES]
TOKENS = [(7 * i + 3) % 64 for i in range(70)]
META = {"model": "tiny"}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2, hidden=256)  # head_dim 64, 4 query heads over 2 KV heads


def _dense_attention(cache, q, keys, values, scale, mask):
    """Dequantize what the cache returned (the slots that hold tokens), move the query into
    the key store's frame and attend with plain matrix products (grouped-query heads
    repeated)."""
    k = cache.kstore.decode(keys) if isinstance(keys, tuple) else keys
    v = cache.vstore.decode(values) if isinstance(values, tuple) else values
    if cache.held is not None:
        k, v = k[..., : cache.held, :], v[..., : cache.held, :]
    q = cache.kstore.queries(q)
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q * scale) @ k.swapaxes(-1, -2)
    if isinstance(mask, str):  # "causal"
        q_len, k_len = s.shape[-2:]
        mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
    if mask is not None:
        s = mx.where(mask, s, mx.finfo(s.dtype).min)
    return mx.softmax(s, axis=-1, precise=True) @ v


@pytest.mark.parametrize("policy", CASES, ids=[p.describe() for p in CASES])
def test_attention_on_the_packed_store_matches_dequantized_reference(model, policy):
    caches = make_caches(model, policy)
    cache = caches[0]
    seen = []
    attend = cache.attend

    packed = []

    def spy(q, k, v, scale, mask, sinks=None):
        packed.append(k if cache.kstore.quantized else v)
        out = attend(q, k, v, scale=scale, mask=mask, sinks=sinks)
        seen.append((out, _dense_attention(cache, q, k, v, scale, mask)))
        return out

    cache.attend = spy
    feed(model, TOKENS, caches, [30, 1, 1, 17, 1, 1, 1, 18])  # decode before/after evicting
    assert len(seen) == 8
    assert sum(isinstance(k, tuple) for k in packed) == 5 * cache.quantized  # decode steps
    for out, ref in seen:
        assert out.shape == ref.shape
        assert mx.abs(out - ref).max().item() < 1e-4


PACKED = [
    KVPolicy(bits=4, group_size=32),  # KIVI keys
    KVPolicy(window=36, sinks=4, bits=4, group_size=32),
    KVPolicy(bits=4, group_size=32, key_scheme="plain"),
    KVPolicy(window=20, sinks=4, bits=4, group_size=32, **ROT),
    KVPolicy(value_bits=4, group_size=32),
]


@pytest.mark.parametrize("policy", PACKED, ids=[p.describe() for p in PACKED])
def test_packed_products_take_the_stored_heads_as_they_are(model, policy, monkeypatch):
    """With 4 query heads over 2 KV heads, every product on packed keys or values (one row
    and a batch of two, prefill and decode) gets the operand with the batch dims of the
    queries, not broadcast over query heads: MLX's GPU kernels have read such a broadcast
    wrong (docs/gpu.md)."""
    calls = []
    qmm = mx.quantized_matmul

    def spy(x, w, *args, **kwargs):
        calls.append((x.shape, w.shape))
        return qmm(x, w, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    rows = [make_caches(model, policy) for _ in range(2)]
    feed(model, TOKENS[:40], rows[0], [37, 1, 1, 1])
    feed(model, TOKENS[:33], rows[1], [33])
    batched = merge_rows(rows)
    mx.eval(model(mx.array([[5], [6]]), cache=batched))
    batch_sizes = {x[0] for x, w in calls}
    assert batch_sizes == {1, 2}, calls
    for x, w in calls:
        assert w[:-2] == x[:-2], (x, w)
        assert x[1] == 2  # the KV heads, each with its query heads as rows


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive"])
def test_attention_over_a_whole_buffer_equals_the_held_prefix(mask):
    """Decoding steps of packed caches attend on their whole buffers (MLX's CUDA quantized
    kernels take no sliced operand), the slots past ``held`` masked: bit for bit the
    attention over the held prefix alone, whatever mask the model passes."""
    held, T, L = 300, 512, 2
    store = QuantStore(4, 32)
    k = store.encode(mx.random.normal((1, 2, T, 64), key=mx.random.key(1)))
    v = store.encode(mx.random.normal((1, 2, T, 64), key=mx.random.key(2)))
    q = mx.random.normal((1, 4, L, 64), key=mx.random.key(3))
    allowed = mx.random.bernoulli(0.8, (1, 1, L, held), key=mx.random.key(4))
    masks = {
        "none": None,
        "causal": "causal",
        "bool": allowed,
        "additive": mx.where(allowed, 0.0, -1e9),
    }
    prefix = tuple(x[..., :held, :] for x in k), tuple(x[..., :held, :] for x in v)
    want = attention(q, *prefix, 0.125, masks[mask], store, store)
    got = attention(q, k, v, 0.125, masks[mask], store, store, held=held)
    assert mx.array_equal(got, want).item()
    if mask == "none":  # the tail, unmasked, would change the answer
        assert not mx.allclose(attention(q, k, v, 0.125, None, store, store), want).item()


FUSED = [
    KVPolicy(bits=4, group_size=32),  # KIVI keys: blocks of queries, each with its mask
    KVPolicy(window=20, sinks=4, bits=4, group_size=32),
    KVPolicy(window=20, sinks=4),  # chunks past the window: sink copies and their mask
    KVPolicy(window=20, sinks=4, bits=4, group_size=32, **ROT),
]


def _fused_masks(model, policy, monkeypatch):
    """The masks the caches hand MLX's fused attention while feeding 70 tokens (chunks and
    decoding steps past the window), and the logits."""
    masks = []
    sdpa = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask=None, **kwargs):
        masks.append((q.dtype, mask))
        return sdpa(q, k, v, scale=scale, mask=mask, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(mx.fast, "scaled_dot_product_attention", spy)
        logits = feed(model, TOKENS[:70], make_caches(model, policy), [30, 1, 25, 1, 13])
    arrays = [(dt, mask) for dt, mask in masks if isinstance(mask, mx.array)]
    assert arrays, "no chunk here was given a mask array"
    return arrays, logits


@pytest.mark.parametrize("policy", FUSED, ids=[p.describe() for p in FUSED])
def test_cudnn_attention_gets_additive_masks(model, policy, monkeypatch):
    """Where MLX runs cuDNN's fused attention (a CUDA GPU), every mask array the caches hand
    it is additive in the queries' dtype and one for every head: MLX would turn a boolean
    one into an array as large as the scores at every call (docs/gpu.md). The logits are
    bit for bit those of the boolean masks."""
    with monkeypatch.context() as m:
        m.setattr(attention_module, "_cudnn_attention", lambda queries, values: True)
        arrays, logits = _fused_masks(model, policy, monkeypatch)
    for dtype, mask in arrays:
        assert mask.dtype == dtype, mask.dtype
        assert mask.ndim < 3 or mask.shape[-3] == 1, mask.shape
    boolean, want = _fused_masks(model, policy, monkeypatch)  # this CPU: MLX's fallback
    assert all(mask.dtype == mx.bool_ for _, mask in boolean)  # a quarter of float32's copy
    assert mx.array_equal(logits, want).item()


def test_cudnn_attention_is_read_as_mlx_decides_it(monkeypatch):
    """cuDNN runs (MLX 0.32's ``supports_sdpa_cudnn``) on a CUDA GPU for more than one query
    row, in float16 or bfloat16, head sizes multiples of 8 up to 128."""
    q = mx.zeros((1, 4, 2, 128), mx.bfloat16)
    v = mx.zeros((1, 2, 9, 128), mx.bfloat16)
    assert not attention_module._cudnn_attention(q, v)  # this machine: MLX's CPU
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert attention_module._cudnn_attention(q, v)
    assert not attention_module._cudnn_attention(q[..., :1, :], v)  # one row: no cuDNN
    assert not attention_module._cudnn_attention(q.astype(mx.float32), v)
    assert not attention_module._cudnn_attention(q, mx.zeros((1, 2, 9, 256), mx.bfloat16))


def test_rotated_keys_are_centred_on_the_first_token(model):
    caches = make_caches(model, KVPolicy(bits=4, group_size=32, **ROT))
    feed(model, TOKENS[:10], caches, [10])
    store = caches[0].kstore
    assert isinstance(store, RotatedKeyStore)
    first = store.restore(tuple(x[..., :1, :] for x in caches[0].keys))
    assert mx.abs(first - store.offset).max().item() < 1e-6  # token 0 - offset == 0: exact


@pytest.mark.parametrize(
    "policy",
    [
        KVPolicy(bits=4, group_size=32),
        KVPolicy(window=20, sinks=4, key_bits=4, value_bits=2, group_size=32),
        KVPolicy(window=24, key_bits=3, group_size=32),
    ],
    ids=lambda p: p.describe(),
)
def test_save_load_keeps_the_scheme(model, policy, tmp_path):
    caches = make_caches(model, policy)
    feed(model, TOKENS[:50], caches, [40, 1, 9])
    path = tmp_path / "q.safetensors"
    meta = dict(META, policy=policy.to_dict())
    save_caches(path, caches, meta)
    loaded = load_caches(path, meta)
    assert [c.nbytes for c in loaded] == [c.nbytes for c in caches]
    assert loaded[0].describe_stores() == caches[0].describe_stores()
    a = feed(model, TOKENS[50:], caches, [5, 1, 1, 13])
    b = feed(model, TOKENS[50:], loaded, [5, 1, 1, 13])
    assert mx.abs(a - b).max().item() == 0.0


def test_state_from_before_separate_stores_reads_as_plain(model):
    """Files written before keys and values had their own stores carry ``bits`` and
    ``group_size`` for both: those were mlx-lm style per-token keys, read as ``plain``."""
    policy = KVPolicy(window=20, sinks=4, bits=4, group_size=32, key_scheme="plain")
    caches = make_caches(model, policy)
    feed(model, TOKENS[:40], caches, [30, 1, 9])
    old = []
    for c in caches:
        state = dict(c.state)
        for key in ("key_bits", "key_group_size", "key_scheme", "value_bits"):
            state.pop(key)
        state.pop("value_group_size")
        state.pop("key_offset")
        state.update(bits=4, group_size=32)
        for key in ("keys", "values", "sink_keys"):  # copies: the live cache writes in place
            state[key] = tree_map(lambda x: x + 0, state[key])
        fresh = StreamingKVCache(None)
        fresh.state = state
        old.append(fresh)
    assert old[0].kstore.describe() == {"bits": 4, "group_size": 32, "scheme": "plain"}
    a = feed(model, TOKENS[40:], caches, [1, 1, 28])
    b = feed(model, TOKENS[40:], old, [1, 1, 28])
    assert mx.abs(a - b).max().item() == 0.0


def test_file_of_another_format_refused_in_one_line(model, tmp_path):
    caches = make_caches(model, KVPolicy(bits=4, group_size=32))
    feed(model, TOKENS[:10], caches, [10])
    save_caches(tmp_path / "a.safetensors", caches, META)
    arrays, meta = mx.load(str(tmp_path / "a.safetensors"), return_metadata=True)
    mx.save_safetensors(str(tmp_path / "b.safetensors"), arrays, {**meta, "0.mlxkv_cache": "2"})
    with pytest.raises(CacheError) as err:
        load_caches(tmp_path / "b.safetensors", META)
    assert str(err.value) == (
        "b.safetensors was saved by an older mlxkv (cache format 2; this one reads 3); "
        "delete it, and the next run saves it again"
    )
    mx.save_safetensors(str(tmp_path / "c.safetensors"), arrays, {**meta, "0.mlxkv_cache": "x"})
    with pytest.raises(CacheError, match="not an mlxkv cache file") as err:
        load_caches(tmp_path / "c.safetensors", META)
    assert "\n" not in str(err.value)


def test_file_with_other_widths_refused(model, tmp_path):
    policy = KVPolicy(bits=4, group_size=32)
    caches = make_caches(model, policy)
    feed(model, TOKENS[:10], caches, [10])
    save_caches(tmp_path / "a.safetensors", caches, dict(META, policy=policy.to_dict()))
    other = KVPolicy(key_bits=4, value_bits=2, group_size=32)
    with pytest.raises(CacheError, match="made with policy="):
        load_caches(tmp_path / "a.safetensors", dict(META, policy=other.to_dict()))
