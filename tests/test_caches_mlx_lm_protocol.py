"""mlxkv caches driven through mlx-lm's own functions (the cache protocol of mlx-lm 0.32.2).

Intended differences from mlx-lm's caches, each checked here:

* ``load_prompt_cache`` resolves classes by name in ``mlx_lm.models.cache``; importing
  ``mlxkv.caches`` adds mlxkv's three class names there.
* A window/sink cache's ``is_trimmable()`` is True only while trims are exact: before the
  first eviction, or within its undo log (``reserve`` tokens, 0 by default). mlx-lm's
  ``RotatingKVCache`` answers the same way (``offset < max_size``) but has no undo log.
* ``keys_and_values()`` returns the kept tokens in temporal order, dense, sinks first at
  their current shift (mlx-lm returns its raw buffer, quantized caches the packed triples).
* ``to_quantized()`` keeps the window, sinks and positions (mlx-lm's ``RotatingKVCache``
  raises).
* A KIVI cache's ``keys_and_values()`` returns what its last update returned (packed after a
  decoding step, as mlx-lm's ``QuantizedKVCache`` does; dense after a prefill chunk): the
  layout its mask describes, which gemma3n's KV-shared layers attend over through
  ``cache.attend``. afm7's KV-reuse layers call mlx-lm's attention with no cache and take
  their query positions from the number of keys, which only a temporal layout gives: afm7
  is refused under KIVI keys and runs with ``rotated`` or ``plain`` ones.
* ``state`` is a dict of named arrays and scalars, not mlx-lm's sequence (``state[0]`` raises
  KeyError; ``state["keys"]``): the names let a file say what it holds (quantization,
  rotation, counters) and older files still load. mlx-lm's ``save_prompt_cache`` and
  ``load_prompt_cache`` take it as it is (they flatten any tree); code that indexes
  ``state`` by position does not.
* ``from_state`` copies the arrays it is given (mlx-lm's shares them; a cache writes into
  its buffers in place), and gives buffers shorter than the cache's step their whole step:
  ``mlxkv.caches.save_caches`` writes a cache that has not evicted with only the slots of
  its tokens (``stored_state``), and mlx-lm's ``load_prompt_cache`` reads it back whole.
* The quantized caches have no ``bits``: mlx-lm's ``scaled_dot_product_attention`` would
  send a cache with ``bits`` to its own quantized attention, which knows nothing of a key
  store's frame (rotated keys, KIVI's per-channel groups). ``make_caches`` routes the model's
  attention calls to ``cache.attend`` instead (``mlxkv.caches.attention``); code that calls
  ``mlx_lm.models.base.scaled_dot_product_attention`` itself must call
  ``routed_attention`` (or ``cache.attend``) to reach them.
* ``KVPolicy.from_flags(max_kv_size=M)`` keeps M tokens like ``RotatingKVCache(M, keep=4)``,
  but its window stays larger than its sinks: below M = 9 it keeps ``(M - 1) // 2`` sinks.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import afm7, base, llama
from mlx_lm.models.cache import (
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from mlxkv.caches import (
    CacheError,
    FullKVCache,
    QuantizedStreamingKVCache,
    StreamingKVCache,
    make_caches,
)
from mlxkv.caches.attention import routed_attention
from mlxkv.caches.build import check_policy
from mlxkv.caches.kivi import KiviKVCache
from mlxkv.policy import KVPolicy, PolicyError
from tests._caches_ref import feed, gpu_rule
from tests.tiny_models import build_family, tiny_llama

POLICIES = [
    KVPolicy(),
    KVPolicy(bits=4, group_size=32),
    KVPolicy(window=12),
    KVPolicy(window=12, sinks=4),
    KVPolicy(window=12, sinks=4, bits=8, group_size=32),
    KVPolicy(window=12, sinks=4, bits=8, group_size=32, key_scheme="rotated"),
]
IDS = [p.describe() for p in POLICIES]
# an undo log (``reserve``) needs per-token keys: KIVI caches rewind only their residual
UNDO = [p for p in POLICIES[2:] if p.key_bits is None or p.key_scheme != "kivi"]
A = [(5 * i + 1) % 64 for i in range(80)]
B = [(11 * i + 7) % 64 for i in range(20)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_mlx_lm_save_load_round_trip(model, policy, tmp_path):
    caches = make_caches(model, policy, rebase_every=9)
    feed(model, A[:40], caches, [30] + [1] * 10)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches, {"who": "test"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"who": "test"}
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    for c, x in zip(caches, loaded, strict=True):
        assert (x.offset, x.kept, x.evicted, x.nbytes) == (c.offset, c.kept, c.evicted, c.nbytes)
    a = feed(model, B[:12], caches, [5, 1, 1, 5])
    b = feed(model, B[:12], loaded, [5, 1, 1, 5])
    assert mx.array_equal(a, b)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_an_mlxkv_file_loads_with_mlx_lm(model, policy, tmp_path):
    """mlxkv's files keep only the slots of the tokens before a window evicts; mlx-lm's
    ``load_prompt_cache`` rebuilds each cache with ``from_state``, which gives it its whole
    step back: the same bytes as the saved cache, the same logits after it."""
    from mlxkv.caches import save_caches

    n = 9  # before the window of 12 (+ 4 sinks) evicts: a part of a KIVI key group
    caches = make_caches(model, policy)
    feed(model, A[:n], caches, [n - 2, 1, 1])
    path = tmp_path / "c.safetensors"
    save_caches(path, caches, {"who": "test"})
    loaded = load_prompt_cache(str(path))
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.nbytes for c in loaded] == [c.nbytes for c in caches]
    a = feed(model, B[:12], caches, [5, 1, 1, 5])
    b = feed(model, B[:12], loaded, [5, 1, 1, 5])
    assert mx.array_equal(a, b)


@pytest.fixture(scope="module")
def gpu_tiny():
    return gpu_rule(tiny_llama(layers=2))


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_mlx_lm_save_load_round_trip_under_the_gpu_rule(gpu_tiny, policy, tmp_path):
    """The same, in bfloat16 with packed 4-bit weights (docs/gpu.md): still bit for bit."""
    test_mlx_lm_save_load_round_trip(gpu_tiny, policy, tmp_path)


def test_loaded_sink_cache_keeps_window_sinks_rotation(model, tmp_path):
    caches = make_caches(model, KVPolicy(window=12, sinks=4))
    feed(model, A[:30], caches, [30])
    save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    (c,) = load_prompt_cache(str(tmp_path / "c.safetensors"))[:1]
    assert type(c) is StreamingKVCache
    assert (c.window, c.sinks, c.evicted) == (12, 4, 14)
    assert c.rotation.same_as(caches[0].rotation)


@pytest.mark.parametrize("policy", POLICIES[2:4], ids=IDS[2:4])
def test_trim_prompt_cache_is_honest(model, policy):
    caches = make_caches(model, policy)
    feed(model, A[:10], caches, [10])
    assert can_trim_prompt_cache(caches)
    assert trim_prompt_cache(caches, 3) == 3 and caches[0].offset == 7
    feed(model, A[7:40], caches, [20, 13])
    assert caches[0].evicted > 0
    assert not can_trim_prompt_cache(caches)
    assert trim_prompt_cache(caches, 3) == 0 and caches[0].tokens_seen == 40


def test_keys_and_values_are_the_kept_tokens(model):
    full = make_caches(model, KVPolicy())
    window = make_caches(model, KVPolicy(window=12))
    feed(model, A[:30], full, [20, 9, 1])
    feed(model, A[:30], window, [20, 9, 1])
    assert window[0].evicted == 18
    fk, fv = full[0].keys_and_values()
    wk, wv = window[0].keys_and_values()
    assert wk.shape[2] == 12
    assert mx.array_equal(wk, fk[..., 18:30, :]) and mx.array_equal(wv, fv[..., 18:30, :])


def test_keys_and_values_sinks_first(model):
    sink = make_caches(model, KVPolicy(window=12, sinks=4))
    full = make_caches(model, KVPolicy())
    feed(model, A[:30], sink, [29, 1])
    feed(model, A[:30], full, [29, 1])
    k, v = sink[0].keys_and_values()
    fk, fv = full[0].keys_and_values()
    assert k.shape[2] == 16
    assert mx.array_equal(v, mx.concatenate([fv[..., :4, :], fv[..., 18:, :]], axis=2))
    # the sinks sit right before the window: rotated forward by the 14 evicted tokens
    moved = sink[0].rotation.shift(fk[..., :4, :], 14)
    assert mx.abs(k[..., :4, :] - moved).max().item() < 1e-5


@pytest.mark.parametrize("policy", [KVPolicy(), KVPolicy(window=12), KVPolicy(window=12, sinks=4)])
def test_to_quantized_keeps_the_policy(model, policy):
    caches = make_caches(model, policy)
    feed(model, A[:30], caches, [29, 1])
    q = caches[0].to_quantized(group_size=32, bits=8)
    assert isinstance(q, QuantizedStreamingKVCache) and q.key_bits == q.value_bits == 8
    assert (q.window, q.sinks, q.kept, q.offset) == (
        getattr(caches[0], "window", None),
        getattr(caches[0], "sinks", 0),
        caches[0].kept,
        caches[0].offset,
    )
    k, _ = caches[0].keys_and_values()
    qk, _ = q.keys_and_values()
    assert mx.abs(k - qk).max().item() < 0.05 * mx.abs(k).max().item()


@pytest.mark.parametrize("policy", POLICIES[2:4], ids=IDS[2:4])
def test_generate_step_kv_bits_quantizes_window_caches(model, policy):
    caches = make_caches(model, policy)
    steps = generate_step(
        mx.array(A[:30]),
        model,
        max_tokens=4,
        prompt_cache=caches,
        kv_bits=8,
        kv_group_size=32,
        quantized_kv_start=0,
    )
    assert len([t for t, _ in steps]) == 4
    assert all(type(c) is QuantizedStreamingKVCache for c in caches)
    assert caches[0].window == 12 and caches[0].tokens_seen == 34


def _tokens(steps) -> list[int]:
    return [t if isinstance(t, int) else t.item() for t, *_ in steps]


@pytest.mark.parametrize("policy", [KVPolicy(), *UNDO], ids=["full", *map(KVPolicy.describe, UNDO)])
def test_speculative_decoding_matches_plain_greedy(model, policy):
    """mlx-lm's speculative decoding rewinds rejected drafts with trim_prompt_cache: with an
    undo log of ``num_draft`` tokens the window and sink caches give plain greedy tokens."""
    draft = tiny_llama(seed=3, layers=1)
    prompt = mx.array(A[:20])
    plain = _tokens(
        generate_step(prompt, model, max_tokens=40, prompt_cache=make_caches(model, policy))
    )
    caches = make_caches(model, policy, reserve=3, rebase_every=7)
    caches += make_caches(draft, policy, reserve=3, rebase_every=7)
    spec = speculative_generate_step(
        prompt,
        model,
        max_tokens=40,
        draft_model=draft,
        num_draft_tokens=3,
        prompt_cache=caches,
    )
    got = [(t, d) for t, _, d in spec]
    assert [t for t, _ in got] == plain
    assert any(d for _, d in got) and not all(d for _, d in got)  # drafts accepted and not


def test_keys_and_values_refused_after_an_evicting_chunk(model):
    """An evicting chunk returned [sink copies][old window][chunk]; its mask fits only that."""
    caches = make_caches(model, KVPolicy(window=12, sinks=4))
    feed(model, A[:30], caches, [30])
    with pytest.raises(CacheError, match="evicting multi-token update"):
        caches[0].keys_and_values()
    feed(model, A[30:31], caches, [1])
    assert caches[0].keys_and_values()[0].shape[2] == 16


def test_class_names_resolve_from_a_file(model, tmp_path):
    caches = [
        FullKVCache(),
        StreamingKVCache(8, 2, caches_rotation(model)),
        QuantizedStreamingKVCache(None, bits=4, group_size=32),
    ]
    save_prompt_cache(str(tmp_path / "e.safetensors"), caches)
    loaded = load_prompt_cache(str(tmp_path / "e.safetensors"))
    assert [type(c).__name__ for c in loaded] == [
        "FullKVCache",
        "StreamingKVCache",
        "QuantizedStreamingKVCache",
    ]
    assert all(c.empty() for c in loaded)


def caches_rotation(model):
    return make_caches(model, KVPolicy(window=8, sinks=2))[0].rotation


def _arrays(state) -> list:
    return [np.array(x) for _, x in tree_flatten(state) if isinstance(x, mx.array)]


@pytest.mark.parametrize("policy", POLICIES[2:], ids=IDS[2:])
def test_from_state_holds_its_own_arrays(model, policy):
    """Tokens written into the original after ``from_state`` do not reach the rebuilt cache."""
    caches = make_caches(model, policy)
    feed(model, A[:20], caches, [19, 1])
    c = caches[0]
    twin = type(c).from_state(c.state)
    before = _arrays(twin.state)
    feed(model, A[20:40], caches, [1] * 20)  # evicts and overwrites every ring slot
    after = _arrays(twin.state)
    assert len(after) == len(before) > 0
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert twin.tokens_seen == 20 and c.tokens_seen == 40
    assert not all(np.array_equal(a, b) for a, b in zip(before, _arrays(c.state), strict=True))


@pytest.mark.parametrize("size", range(1, 10))
def test_small_max_kv_size_keeps_that_many_tokens(model, size):
    policy = KVPolicy.from_flags(max_kv_size=size)
    assert policy.kept_tokens == size and policy.window > policy.sinks
    assert policy.sinks == min(4, (size - 1) // 2)
    caches = make_caches(model, policy)
    feed(model, A[:20], caches, [12, 1, 7])
    assert [c.kept for c in caches] == [size] * len(caches)


def test_max_kv_size_too_small_for_the_sinks_asked_names_max_kv_size():
    with pytest.raises(PolicyError) as e:
        KVPolicy.from_flags(max_kv_size=6, sinks=4)
    assert str(e.value) == (
        "--max-kv-size 6 with 4 sink tokens leaves a window of 2, which must be larger than "
        "the sinks; give --max-kv-size 9 or more, or fewer --kv-sinks"
    )
    with pytest.raises(PolicyError, match="^--max-kv-size 3 with 4 sink tokens leaves no window,"):
        KVPolicy.from_flags(max_kv_size=3, sinks=4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(group_size=32), "--kv-group-size applies to a quantized cache; add --kv-bits B"),
        (
            dict(value_group_size=32, window=64),
            "--kv-value-group-size applies to a quantized cache; add --kv-bits B",
        ),
        (dict(bits=4, group_size=0), "--kv-group-size 0 is not supported; use one of 32, 64, 128"),
        (
            dict(key_bits=4, value_group_size=0),
            "--kv-value-group-size 0 is not supported; use one of 32, 64, 128",
        ),
    ],
)
def test_group_sizes_that_nothing_would_use_are_refused(flags, message):
    """A group size of 0 was read as the default, and one without bits did nothing."""
    with pytest.raises(PolicyError) as e:
        KVPolicy.from_flags(**flags)
    assert str(e.value) == message


@pytest.mark.parametrize("bits, scheme", [(4, "kivi"), (8, "kivi"), (8, "rotated")])
def test_quantized_caches_serve_kv_shared_layers(bits, scheme):
    """gemma3n's last layers attend over an earlier layer's cache (``keys_and_values()``):
    with quantized keys the model runs, and chunked prefill equals token-by-token decoding."""
    gemma3n = build_family("gemma3n")
    policy = KVPolicy(bits=bits, group_size=32, key_scheme=scheme)
    check_policy(gemma3n, policy)
    caches = make_caches(gemma3n, policy)
    kind = KiviKVCache if scheme == "kivi" else QuantizedStreamingKVCache
    assert any(type(c) is kind for c in caches)
    tokens = [(7 * i + 3) % 128 for i in range(90)]
    chunked = feed(gemma3n, tokens, caches, [33, 1, 1, 20, 35])
    stepped = feed(gemma3n, tokens, make_caches(gemma3n, policy), [1] * 90)
    # A chunk's projections round differently from a step's (other kernels, on a GPU other
    # precisions), which can tip key elements to the next quantization level: 1.2e-3 and
    # 3.6e-3 seen on the CPU (4e-6 without a tip). Attending over anything but the same
    # quantized keys costs the quantization's own error: 2.8e-2 or more (seeds 0-5).
    assert mx.abs(chunked - stepped).max().item() < 1e-2
    full = feed(gemma3n, tokens, make_caches(gemma3n, KVPolicy()), [90])
    if bits == 8:  # the shared layers read the quantized keys, not something else
        assert mx.abs(chunked - full).max().item() < 0.1


def test_kivi_keys_and_values_is_the_last_update(model):
    policy = KVPolicy(bits=4, group_size=32)
    shared = [c for c in make_caches(build_family("gemma3n"), policy) if type(c) is KiviKVCache]
    assert shared and all(c.shared for c in shared)
    caches = make_caches(model, policy)
    c = caches[0]
    assert not c.shared  # llama's layers read only their own cache
    assert c.keys_and_values() == (None, None)
    feed(model, A[:40], caches, [40])
    with pytest.raises(CacheError, match="not built as shared"):
        c.keys_and_values()  # a chunk's dense output is not kept where nobody reads it
    feed(model, A[40:41], caches, [1])
    k, _ = c.keys_and_values()
    assert isinstance(k, tuple) and k[0].dtype == mx.uint32  # the packed ring after a step
    c.shared = True
    feed(model, A[41:60], caches, [19])
    k, v = c.keys_and_values()
    assert isinstance(k, mx.array) and k.shape[2] >= 19  # dense after a chunk
    loaded = KiviKVCache.from_state(c.state)
    with pytest.raises(CacheError, match="before its first update"):
        loaded.keys_and_values()


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_state_is_a_mapping_by_name(model, policy):
    caches = make_caches(model, policy)
    feed(model, A[:20], caches, [20])
    state = caches[0].state
    if isinstance(caches[0], FullKVCache):  # mlx-lm's own class: its sequence
        assert state[0].shape[2] >= 20 and state[1].shape == state[0].shape
        return
    with pytest.raises(KeyError):
        state[0]
    assert "tokens_seen" in state and state["tokens_seen"] == 20
    assert "values" in state and not isinstance(state["values"], (int, str))


@pytest.mark.parametrize("policy", POLICIES[1:2] + POLICIES[4:], ids=IDS[1:2] + IDS[4:])
def test_quantized_caches_have_no_bits_and_attention_is_routed(model, policy):
    caches = make_caches(model, policy)
    c = caches[0]
    assert c.quantized and not hasattr(c, "bits")
    # make_caches routed the model's module: its calls reach cache.attend
    assert llama.scaled_dot_product_attention is routed_attention
    assert base.scaled_dot_product_attention is not routed_attention
    feed(model, A[:20], caches, [20])
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(0))
    kv = mx.random.normal((1, 2, 1, 32), key=mx.random.key(1))
    keys, values = c.update_and_fetch(kv, kv)
    mask = None
    got = routed_attention(q, keys, values, cache=c, scale=0.25, mask=mask)
    want = c.attend(q, keys, values, scale=0.25, mask=mask)
    assert mx.array_equal(got, want)


def _tiny_afm7():
    mx.random.seed(0)
    args = afm7.ModelArgs(
        model_type="afm7",
        vocab_size=128,
        hidden_dim=128,
        num_layers=3,
        num_kv_reuse_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    model = afm7.Model(args)
    mx.eval(model.parameters())
    return model


def test_afm7_kv_reuse_layers_refuse_kivi_and_run_per_token_keys():
    model = _tiny_afm7()
    with pytest.raises(PolicyError, match="^afm7: .*drop --kv-bits$"):
        check_policy(model, KVPolicy(bits=8, group_size=32))
    tokens = [(7 * i + 3) % 128 for i in range(70)]
    full = feed(model, tokens, make_caches(model, KVPolicy()), [70])
    for scheme in ("rotated", "plain"):
        policy = KVPolicy(bits=8, group_size=32, key_scheme=scheme)
        check_policy(model, policy)
        chunked = feed(model, tokens, make_caches(model, policy), [40, 1, 29])
        stepped = feed(model, tokens, make_caches(model, policy), [1] * 70)
        assert mx.abs(chunked - stepped).max().item() < 1e-4, scheme
        assert mx.abs(chunked - full).max().item() < 0.1 * mx.abs(full).max().item(), scheme
