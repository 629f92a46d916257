"""KIVI keys (per channel, groups along tokens, full-precision residual): logits against a
reference that quantizes each complete group and attends explicitly, chunked prefill against
token-by-token decoding, exact bytes, save/load, trim."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.caches import (
    CacheError,
    KiviKVCache,
    load_caches,
    make_caches,
    save_caches,
    trim_caches,
    trimmable,
)
from mlxkv.memory import policy_bytes
from mlxkv.policy import KVPolicy
from tests._caches_ref import feed, reference_logits
from tests.tiny_models import tiny_llama

TOKENS = [(7 * i + 3) % 64 for i in range(90)]
META = {"model": "tiny"}
SHAPES = [dict(), dict(window=40), dict(window=36, sinks=4), dict(window=20, sinks=4)]
WIDTHS = [
    dict(bits=4, group_size=32),
    dict(bits=3, group_size=32),
    dict(key_bits=4, value_bits=2, group_size=32),
    dict(key_bits=4, group_size=32),  # values unquantized
]
CASES = [KVPolicy(**shape, **w) for shape in SHAPES for w in WIDTHS]
CHUNKS = [[90], [1] * 90, [37, 1, 1, 5, 1, 30, 15], [13, 64, 1, 1, 11]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2, hidden=256)  # head_dim 64, 4 query heads over 2 KV heads


def test_default_scheme_is_kivi(model):
    policy = KVPolicy(bits=4)
    assert policy.key_scheme == "kivi"
    assert isinstance(make_caches(model, policy)[0], KiviKVCache)


@pytest.mark.parametrize("policy", CASES, ids=[p.describe() for p in CASES])
def test_logits_match_a_reference_that_quantizes_each_group(model, policy):
    ref = reference_logits(
        model, TOKENS, policy.sinks, policy.window, frame="absolute", policy=policy
    )
    for chunks in CHUNKS[1:3]:
        got = feed(model, TOKENS, make_caches(model, policy), chunks)
        assert mx.abs(got - ref).max().item() < 2e-4, chunks


@pytest.mark.parametrize("policy", CASES[::2], ids=[p.describe() for p in CASES[::2]])
def test_chunked_prefill_equals_token_by_token(model, policy):
    one = feed(model, TOKENS, make_caches(model, policy), CHUNKS[1])
    for chunks in (CHUNKS[0], CHUNKS[2], CHUNKS[3]):
        got = feed(model, TOKENS, make_caches(model, policy), chunks)
        assert mx.abs(got - one).max().item() < 2e-5, chunks


@pytest.mark.parametrize(
    "policy",
    [
        KVPolicy(bits=4, group_size=32),
        KVPolicy(window=100, sinks=4, bits=4, group_size=64),
        KVPolicy(window=20, sinks=4, key_bits=4, value_bits=2, group_size=32),
        KVPolicy(window=24, bits=3, group_size=128, value_group_size=32),
    ],
    ids=lambda p: p.describe(),
)
def test_nbytes_equal_the_memory_model_at_every_step(model, policy):
    caches = make_caches(model, policy)
    attn = model.model.layers[0].self_attn
    heads, dim = attn.n_kv_heads, model.args.hidden_size // model.args.num_attention_heads
    tokens = [(5 * i + 1) % 64 for i in range(301)]
    seen = 0
    for c in [1, 2, 3, 30, 1, 1, 100, 1, 62, 100]:
        feed(model, tokens[seen : seen + c], caches, [c])
        seen += c
        want = policy_bytes.allocated_bytes(policy, heads, dim, dim, 4, seen)
        assert caches[0].nbytes == want, seen
        assert caches[0].kept == policy_bytes.kept_tokens(policy, seen)


def test_decode_multiplies_on_the_packed_keys(model):
    """A decoding step hands attention the packed K^T (no dequantized copy of the ring)."""
    caches = make_caches(model, KVPolicy(bits=4, group_size=32))
    feed(model, TOKENS[:40], caches, [40])
    cache = caches[0]
    got = []
    attend = cache.attend

    def spy(q, k, v, scale, mask, sinks=None):
        got.append(k)
        return attend(q, k, v, scale=scale, mask=mask, sinks=sinks)

    cache.attend = spy
    feed(model, TOKENS[40:41], caches, [1])
    packed, scales, biases = got[0]
    assert packed.dtype == mx.uint32 and packed.shape[-2] == 64  # (B, H, D, C * bits / 32)
    assert scales.shape[-1] == 256 // 32  # one scale per channel and group of 32 tokens


@pytest.mark.parametrize(
    "policy",
    [KVPolicy(bits=4, group_size=32), KVPolicy(window=20, sinks=4, bits=3, group_size=32)],
    ids=lambda p: p.describe(),
)
def test_save_load_round_trip(model, policy, tmp_path):
    caches = make_caches(model, policy)
    feed(model, TOKENS[:50], caches, [40, 1, 9])
    path = tmp_path / "k.safetensors"
    meta = dict(META, policy=policy.to_dict())
    save_caches(path, caches, meta)
    loaded = load_caches(path, meta)
    assert all(isinstance(c, KiviKVCache) for c in loaded)
    assert [c.nbytes for c in loaded] == [c.nbytes for c in caches]
    assert loaded[0].describe_stores() == caches[0].describe_stores()
    a = feed(model, TOKENS[50:], caches, [5, 1, 1, 33])
    b = feed(model, TOKENS[50:], loaded, [5, 1, 1, 33])
    assert mx.abs(a - b).max().item() == 0.0


def test_file_of_the_rotated_scheme_refused_in_one_line(model, tmp_path):
    rotated = KVPolicy(bits=4, group_size=32, key_scheme="rotated")
    caches = make_caches(model, rotated)
    feed(model, TOKENS[:10], caches, [10])
    save_caches(tmp_path / "a.safetensors", caches, dict(META, policy=rotated.to_dict()))
    kivi = KVPolicy(bits=4, group_size=32)
    with pytest.raises(CacheError, match="made with policy=") as err:
        load_caches(tmp_path / "a.safetensors", dict(META, policy=kivi.to_dict()))
    assert "\n" not in str(err.value)


def test_trim_inside_the_residual_is_exact_and_stops_at_a_quantized_group(model):
    policy = KVPolicy(bits=4, group_size=32)
    caches = make_caches(model, policy)
    feed(model, TOKENS[:75], caches, [75])  # groups [0, 32), [32, 64) quantized; 11 held
    assert trimmable(caches[0]) == 11
    with pytest.raises(CacheError, match="at most 11"):
        trim_caches(caches, 20)
    assert trim_caches(caches, 11) == 11
    a = feed(model, TOKENS[64:80], caches, [3, 1, 12])
    b = feed(model, TOKENS[:80], make_caches(model, policy), [80])[:, 64:]
    assert mx.abs(a - b).max().item() < 2e-5
    assert trimmable(caches[0]) == 80 - 64


@pytest.mark.model
def test_engine_greedy_answers_on_the_default_model(default_model):
    """Through the engine (chunked prefill, decode on the packed keys, bytes predicted):
    8-bit KIVI answers token for token like the unquantized cache; 4-bit still says Paris."""
    from mlxkv.engine.chat import ChatSession
    from mlxkv.engine.events import Finished
    from mlxkv.engine.session import GenerationSettings, Session

    settings = GenerationSettings(max_tokens=24, temperature=0.0, prefill_step=16)

    def answer(policy):
        *_, last = ChatSession(Session(default_model, policy), settings).send(
            "What is the capital of France?"
        )
        assert isinstance(last, Finished)
        assert last.stats.kv_bytes_actual == last.stats.kv_bytes_predicted
        return last.text

    plain = answer(KVPolicy())
    assert answer(KVPolicy(bits=8)) == plain
    assert "Paris" in answer(KVPolicy(bits=4))


@pytest.mark.parametrize("policy", CASES[:2], ids=[p.describe() for p in CASES[:2]])
def test_a_pipeline_send_tied_to_the_last_cache_changes_nothing(model, policy):
    """mlx-lm's pipeline models run ``cache[-1].keys = mx.depends(cache[-1].keys, h)`` on
    every rank but the first, so the next step runs the send; a KIVI cache must take that
    (it once raised AttributeError, refusing --kv-bits under --shard pipeline) and go on
    as before, its value store still a triple."""
    plain = feed(model, TOKENS, make_caches(model, policy), CHUNKS[2])
    caches, tokens, outs, p = make_caches(model, policy), mx.array(TOKENS), [], 0
    for c in CHUNKS[2]:
        h = model(tokens[None, p : p + c], cache=caches)
        caches[-1].keys = mx.depends(caches[-1].keys, h)
        mx.eval(h)
        outs.append(h)
        p += c
    assert isinstance(caches[-1].values, tuple)
    assert mx.array_equal(mx.concatenate(outs, axis=1), plain).item()
