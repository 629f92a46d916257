"""Every policy against a slow reference that recomputes attention over the kept tokens.

Tiny random llama models (float32), so these run in seconds; the default-model versions
live in test_caches_model.py.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from mlxkv.caches import make_caches
from mlxkv.policy import KVPolicy
from tests._caches_ref import feed, reference_logits
from tests.tiny_models import tiny_llama

T = 120
CHUNKS = [37, 1, 1, 45, 3, 1, 25, 1, 1, 5]  # prefill, decode, chunk spanning evictions...
TOL = 2e-5


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


@pytest.fixture(scope="module")
def model1():
    return tiny_llama(layers=1)


@pytest.fixture(scope="module")
def tokens():
    mx.random.seed(1)
    return mx.random.randint(0, 64, (T,)).tolist()


def _ref(model, tokens, policy, frame):
    return reference_logits(model, tokens, policy.sinks, policy.window, frame=frame, policy=policy)


@pytest.mark.parametrize(
    "policy",
    [KVPolicy(), KVPolicy(window=24), KVPolicy(window=20, sinks=4), KVPolicy(window=9, sinks=1)],
    ids=lambda p: p.describe(),
)
def test_unquantized_matches_within_cache_positions(model, tokens, policy):
    assert sum(CHUNKS) == T
    ref = _ref(model, tokens, policy, "within")
    chunked = feed(model, tokens, make_caches(model, policy), CHUNKS)
    assert mx.abs(chunked - ref).max().item() < TOL
    stepwise = feed(model, tokens, make_caches(model, policy), [4] + [1] * (T - 4))
    assert mx.abs(stepwise - ref).max().item() < TOL


@pytest.mark.parametrize(
    "policy",
    [
        KVPolicy(bits=8, group_size=32),
        KVPolicy(bits=4, group_size=32),
        KVPolicy(window=24, bits=6, group_size=32),
        KVPolicy(window=20, sinks=4, bits=4, group_size=32),
        KVPolicy(window=20, sinks=4, bits=3, group_size=32),
        KVPolicy(window=20, sinks=4, bits=2, group_size=32),
        KVPolicy(window=20, sinks=4, bits=5, group_size=32),
        KVPolicy(bits=4, group_size=32, key_scheme="plain"),
        KVPolicy(window=20, sinks=4, bits=4, group_size=32, key_scheme="plain"),
        KVPolicy(key_bits=4, value_bits=2, group_size=32),
        KVPolicy(window=20, sinks=4, key_bits=4, value_bits=2, group_size=32),
        KVPolicy(window=24, key_bits=3, value_bits=8, group_size=32, value_group_size=32),
        KVPolicy(window=20, sinks=4, key_bits=4, group_size=32),
        KVPolicy(value_bits=4, group_size=32),
    ],
    ids=lambda p: p.describe(),
)
def test_quantized_matches_reference(model1, tokens, policy):
    # Quantization does not commute with rotation: compare in the cache's own frame. One
    # layer: deeper layers see fp32-noise-different keys (BLAS blocking differs with the
    # chunk length), and a key on a rounding boundary then quantizes one step apart.
    ref = _ref(model1, tokens, policy, "absolute")
    got = feed(model1, tokens, make_caches(model1, policy), CHUNKS)
    assert mx.abs(got - ref).max().item() < TOL
    effect = mx.abs(ref - _ref(model1, tokens, KVPolicy(policy.window, policy.sinks), "absolute"))
    assert effect.max().item() > 100 * TOL  # quantization is really on


@pytest.mark.parametrize(
    "policy",
    [
        KVPolicy(window=80, sinks=48),  # 2 shifts rotated ahead at once
        KVPolicy(window=66, sinks=65),  # one at a time: the block would hold 4.6x the KV
        KVPolicy(window=66, sinks=65, key_bits=4, group_size=32),
    ],
    ids=lambda p: p.describe(),
)
def test_many_sinks_decode_as_the_reference(model1, policy):
    """Many sinks rotate fewer shifts ahead (shifts_ahead); each step still sees its sinks
    exactly where the reference puts them."""
    mx.random.seed(2)
    tokens = mx.random.randint(0, 64, (200,)).tolist()
    frame = "absolute" if policy.key_bits else "within"
    ref = _ref(model1, tokens, policy, frame)
    got = feed(model1, tokens, make_caches(model1, policy), [150] + [1] * 50)
    assert mx.abs(got - ref).max().item() < TOL


ROPES = {
    "llama3": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        max_position_embeddings=512,
    ),
    "linear": dict(rope_scaling={"type": "linear", "factor": 2.0}),
    "yarn": dict(  # mscale != 1: the magnitude factor must not be applied twice
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        max_position_embeddings=128,
    ),
    "longrope": dict(
        rope_scaling={
            "type": "longrope",
            "original_max_position_embeddings": 32,
            "short_factor": [1.0] * 16,
            "long_factor": [1.0 + 0.1 * i for i in range(16)],
        },
        max_position_embeddings=128,
    ),
    "traditional": dict(),
}


@pytest.mark.parametrize("variant", sorted(ROPES))
def test_rope_variants_reposition_exactly(variant, tokens):
    model = tiny_llama(layers=1, **ROPES[variant])
    if variant == "traditional":
        model.layers[0].self_attn.rope.traditional = True
    policy = KVPolicy(window=16, sinks=4)
    ref = _ref(model, tokens[:80], policy, "within")
    got = feed(model, tokens[:80], make_caches(model, policy), [30, 1, 1, 40, 1, 7])
    assert mx.abs(got - ref).max().item() < TOL


def test_reference_tells_mlx_lm_rotating_cache_apart(model, tokens):
    """mlx-lm's RotatingKVCache(keep=4) keeps sinks at their first positions: past the
    first eviction it is *not* StreamingLLM, and the reference sees the difference."""
    ref = _ref(model, tokens[:60], KVPolicy(window=20, sinks=4), "within")
    caches = [RotatingKVCache(24, keep=4) for _ in model.layers]
    got = feed(model, tokens[:60], caches, [1] * 60)
    assert mx.abs(got[:, :24] - ref[:, :24]).max().item() < TOL  # same before evicting
    assert mx.abs(got - ref).max().item() > 1e-2


def test_rebase_keeps_logits(model, tokens):
    """Rebasing the frame every few evictions changes no logit beyond fp32 noise."""
    policy = KVPolicy(window=20, sinks=4)
    ref = _ref(model, tokens, policy, "within")
    for q in (None, 4):
        pol = policy if q is None else KVPolicy(window=20, sinks=4, bits=8, group_size=32)
        caches = make_caches(model, pol, rebase_every=3)
        got = feed(model, tokens, caches, CHUNKS)
        assert caches[0].offset < 24 + 3 + 26  # the frame stays small
        if q is None:
            assert mx.abs(got - ref).max().item() < TOL
        else:  # re-quantized after a rebase: close, not bit-equal
            assert mx.abs(got - ref).max().item() < 0.15


def test_batch_of_two(model, tokens):
    policy = KVPolicy(window=20, sinks=4)
    toks2 = mx.array([tokens[:60], tokens[60:]])
    caches = make_caches(model, policy)
    out = [model(toks2[:, :30], cache=caches)]
    out += [model(toks2[:, i : i + 1], cache=caches) for i in range(30, 60)]
    got = mx.concatenate(out, axis=1)
    for b in range(2):
        ref = _ref(model, toks2[b].tolist(), policy, "within")
        assert mx.abs(got[b : b + 1] - ref).max().item() < TOL
