"""Cache policies on the offline default model (SmolLM2-135M, 30 layers, float32 on CPU).

Unquantized policies match the explicit reference to fp32 tolerance and decode the same
greedy tokens as StreamingLLM done literally. Quantized policies cannot be compared at
fp32 tolerance on a deep model: a 1e-6 difference (BLAS blocking differs with the chunk
length, even between two runs of our own cache) moves a key across a rounding boundary,
and through 30 layers that re-draws the quantization noise. The exact quantized checks run
on one-layer models (test_caches_reference.py); here the quantized caches must be as good
as the reference within a fraction of what quantization itself costs.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxkv.caches import make_caches
from mlxkv.memory import policy_bytes as pb
from mlxkv.policy import KVPolicy
from tests._caches_ref import LiteralStreamingCache, feed, greedy, reference_logits

pytestmark = pytest.mark.model

TEXT = (
    "The lighthouse keeper had kept the lamp burning for thirty years, through storms that "
    "tore the slates from the roof and calm nights when the sea lay flat as a mirror. Every "
    "evening he climbed the hundred and twelve steps, trimmed the wick, polished the great "
    "lens and wrote a line in the log: the wind, the weather, the ships that passed. His "
    "daughter, who had grown up on the rock, knew the names of all the birds that nested in "
    "the cliffs and could tell the tides by the sound of the water in the caves below. When "
    "the letter came from the harbour board announcing that the light would be automated, "
    "he read it twice, folded it carefully and put it in the drawer with the others. Then he "
    "went up the steps as usual, because the ships would still be out there tonight, and a "
    "lamp does not light itself, whatever the board might think. In the morning his daughter "
    "found him asleep in the chair by the window, the log open on his knees, and the last "
    "line written in a steady hand: wind from the west, sea moderate, all ships safe."
)


@pytest.fixture(scope="module")
def model(default_model):
    return default_model.model


@pytest.fixture(scope="module")
def ids(default_model):
    return default_model.tokenizer.encode(TEXT)


def test_default_model_exact_bytes(model):
    """nbytes == policy_bytes at every step of a schedule that crosses an allocation step,
    evicts and fills quantization groups. Every layer's cache has the same shape, so the
    model runs cut to its first 3 layers (the whole model ran the same check in 19 s)."""
    tokens = [(37 * i) % 40000 + 100 for i in range(304)]
    schedule = [260, 1, 1, 41, 1]
    layers = model.model.layers
    model.model.layers = layers[:3]
    try:
        for policy in (
            KVPolicy(),
            KVPolicy(bits=4, group_size=32),
            KVPolicy(window=96, sinks=4),
            KVPolicy(window=96, sinks=4, bits=8),
            KVPolicy(window=64, bits=4),
        ):
            caches = make_caches(model, policy)
            assert len(caches) == 3
            seen = 0
            for n in schedule:
                mx.eval(model(mx.array(tokens[seen : seen + n])[None], cache=caches))
                seen += n
                predicted = pb.allocated_bytes(policy, 3, 64, 64, 4, seen, 1)
                assert sum(c.nbytes for c in caches) == 3 * predicted, (policy, seen)
                kept = pb.kept_tokens(policy, seen)
                assert caches[0].kept == kept <= (policy.kept_tokens or seen)
    finally:
        model.model.layers = layers


def test_default_model_greedy_matches_literal_streamingllm(model, ids):
    """The window slides at every step: 4 evictions in prefill, then one per token (2,048
    tokens in the slow test below)."""
    policy = KVPolicy(window=40, sinks=4)
    ours = greedy(model, ids[:48], make_caches(model, policy), 12, [40, 8])
    literal = [LiteralStreamingCache(4, 40, layer.self_attn.rope) for layer in model.layers]
    assert ours == greedy(model, ids[:48], literal, 12)


@pytest.mark.slow
def test_default_model_greedy_2k_tokens(model, ids):
    """>= 2k decoded tokens, hundreds of evictions and several rebases, token for token."""
    policy = KVPolicy(window=252, sinks=4)
    caches = make_caches(model, policy, rebase_every=512)
    ours = greedy(model, ids[:64], caches, 2048, [48, 16])
    assert caches[0].evicted > 1800 and caches[0].offset < 256 + 512 + 2
    literal = [LiteralStreamingCache(4, 252, layer.self_attn.rope) for layer in model.layers]
    assert ours == greedy(model, ids[:64], literal, 2048)


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [KVPolicy(), KVPolicy(window=48), KVPolicy(window=44, sinks=4)],
    ids=lambda p: p.describe(),
)
def test_default_model_reference_logits(model, ids, policy):
    tokens = ids[:200]
    ref = reference_logits(model, tokens, policy.sinks, policy.window)
    got = feed(model, tokens, make_caches(model, policy), [90, 1, 1, 100, 1, 7])
    assert mx.abs(got - ref).max().item() < 5e-3  # logits up to ~40
    assert mx.array_equal(got.argmax(-1), ref.argmax(-1))


def _nll(logits, tokens):
    y = mx.array(tokens[1:])
    return nn.losses.cross_entropy(logits[0, :-1], y).mean().item()


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [KVPolicy(bits=8), KVPolicy(window=44, sinks=4, bits=4)],
    ids=lambda p: p.describe(),
)
def test_default_model_quantized_within_noise(model, ids, policy):
    tokens = ids[:200]
    fp = _nll(reference_logits(model, tokens, policy.sinks, policy.window), tokens)
    ref = reference_logits(
        model, tokens, policy.sinks, policy.window, frame="absolute", policy=policy
    )
    got = feed(model, tokens, make_caches(model, policy), [90, 1, 1, 100, 1, 7])
    cost = abs(_nll(ref, tokens) - fp)  # what quantization itself costs
    assert abs(_nll(got, tokens) - _nll(ref, tokens)) < 0.3 * cost + 0.005
    assert (got.argmax(-1) == ref.argmax(-1)).mean().item() > 0.85
