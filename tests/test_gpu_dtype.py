"""The GPU dtype rule, run on the CPU: bfloat16 activations and KV, packed 4-bit weights.

A GPU (Metal, CUDA) keeps the checkpoint's dtype and packed weights (docs/gpu.md); every
other model test runs float32. Here the same behaviours run under the GPU rule: the
default model loaded as a GPU loads it (``gpu_model``: Q4_1 -> MLX 4-bit group 32,
bfloat16), and the tiny random llama the cache tests build, quantized the same way.

bfloat16 and quantized matmuls have no fast path on the CPU (the default model processes
about 2 tokens/s under this rule on these machines), so prompts and answers are short and
the per-policy checks run on the default model cut to its first layers (``shallow``: the
real weights, embeddings and tied head, 2 of 30 layers).

Tolerances: mlxkv's full cache and mlx-lm's ``KVCache`` run the same ops in the same dtype,
so greedy tokens are identical. Our sink cache against StreamingLLM done literally (keys
re-rotated at within-cache positions every step) is exact in float32 on the default model
(test_caches_model.py); in bfloat16 the literal reference rounds each re-rotation again,
so the two differ by bfloat16 rounding: logits within 0.1 (their spread is about 20).
KIVI is compared with nothing but itself (its batched == single, its file round trip,
its bytes), as mlx-lm has no per-channel key cache to compare with.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate

from mlxkv.caches import load_caches, make_caches, save_caches
from mlxkv.engine.events import Finished, PrefillProgress, TokenDelta
from mlxkv.engine.request import encode_prompt
from mlxkv.engine.session import GenerationSettings, Session
from mlxkv.memory import policy_bytes as pb
from mlxkv.policy import KVPolicy
from tests._caches_ref import LiteralStreamingCache, feed

pytestmark = pytest.mark.model

POLICIES = [
    KVPolicy(),
    # the sink + window and the 4-bit caches: the sink + window + 4-bit one runs both in CI
    pytest.param(KVPolicy(window=8, sinks=4), marks=pytest.mark.slow),
    pytest.param(KVPolicy(bits=4, group_size=32), marks=pytest.mark.slow),
    KVPolicy(bits=8, group_size=32),
    KVPolicy(window=8, sinks=4, bits=4, group_size=32),
]
PROMPT = [504, 1135, 9789, 1488, 5152, 253, 18000, 327, 1314, 3542, 1123, 29, 1087, 2765]


@pytest.fixture(scope="module")
def shallow(default_model_path):
    """The default model under the GPU rule, cut to its first two layers."""
    from mlxkv.models.loader import load

    loaded = load(default_model_path, "bfloat16", packed=True)
    loaded.model.model.layers = loaded.model.model.layers[:2]
    config = dict(loaded.config, num_hidden_layers=2)
    return dataclasses.replace(loaded, config=config)


def _floats(model) -> set:
    return {
        v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)
    }


def test_the_gpu_rule_keeps_q4_packed_and_everything_else_bfloat16(gpu_model, default_model):
    assert gpu_model.dtype == "bfloat16" and gpu_model.packed and not default_model.packed
    q = gpu_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 32)
    assert _floats(gpu_model.model) == {mx.bfloat16}
    assert _floats(default_model.model) == {mx.float32}
    # what the plan predicts a GPU holds: the file's packed weights at 2 bytes per float
    from mlxkv.memory.weights import from_local

    planned = from_local(gpu_model.path, gpu_model.config, "bfloat16", False)
    assert planned.bytes == gpu_model.weights_bytes


def test_the_cpu_rule_dequantizes_to_the_checkpoints_exact_values(default_model):
    """Each packed weight computed in float32 from the file's float16 scales and biases,
    not rounded to float16 on the way (MLX's dequantize on the file's own dtype)."""
    file = mx.load(str(default_model.path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    w, s, b = (file[f"{name}.{k}"] for k in ("weight", "scales", "biases"))
    exact = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), 32, 4)
    held = default_model.model.model.layers[0].self_attn.q_proj.weight
    assert held.dtype == mx.float32 and mx.array_equal(held, exact)
    assert not mx.array_equal(held, mx.dequantize(w, s, b, 32, 4).astype(mx.float32))


def test_greedy_tokens_are_mlx_lms_under_the_gpu_rule(gpu_model):
    """Full depth, the same packed bfloat16 weights for both: identical tokens. (MLX's
    bfloat16 quantized matmul on the CPU costs about 1.5 s a token: a short prompt.)"""
    prompt = "The capital of"
    settings = GenerationSettings(max_tokens=2, prefill_step=2)
    ours = [
        ev.token
        for ev in Session(gpu_model).run(prompt, settings)
        if isinstance(ev, TokenDelta) and ev.token >= 0
    ]
    ids = encode_prompt(gpu_model.tokenizer, prompt)
    ref = [
        r.token
        for r in stream_generate(
            gpu_model.model, gpu_model.tokenizer, mx.array(ids), max_tokens=2, prefill_step_size=2
        )
    ]
    assert ours == ref[: len(ours)] and len(ours) == 2


def _body(shallow):
    """The layers without the head: hidden states compare as strictly as logits, and the
    49152-row packed head is most of the cost of a call on the CPU."""
    return shallow.model.model


def _max_diff(a, b) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def test_full_cache_is_mlx_lms_kv_cache_bit_for_bit(shallow):
    from mlx_lm.models.cache import make_prompt_cache

    body = _body(shallow)
    ours = feed(body, PROMPT + [7, 8], make_caches(shallow.model, KVPolicy()), [8, 6, 1, 1])
    ref = feed(body, PROMPT + [7, 8], make_prompt_cache(shallow.model), [8, 6, 1, 1])
    assert ours.dtype == mx.bfloat16 and mx.array_equal(ours, ref)


def test_sink_cache_is_literal_streamingllm_to_bfloat16_rounding(shallow):
    """Until the window fills, our sink cache is mlx-lm's full cache bit for bit. After it
    evicts, it is compared with StreamingLLM done literally, which rounds every key's
    un-rotation and re-rotation to bfloat16: allowed twice the error that reference shows
    against the exact answer (the full cache) before eviction, about 1% of the hidden
    state's scale (its float32 counterpart agrees to 1e-5: test_caches_model.py)."""
    from mlx_lm.models.cache import make_prompt_cache

    body, model = _body(shallow), shallow.model
    ours = make_caches(model, KVPolicy(window=8, sinks=4))
    literal = [LiteralStreamingCache(4, 8, layer.self_attn.rope) for layer in model.layers]
    full = make_prompt_cache(model)
    own_error, after = 0.0, 0.0
    for i, t in enumerate(PROMPT + [7, 8, 9]):
        x = mx.array([[t]])
        a, b, c = body(x, cache=ours), body(x, cache=literal), body(x, cache=full)
        if i < 12:  # 4 sinks + 8 window: nothing evicted yet
            assert mx.array_equal(a, c), i
            own_error = max(own_error, _max_diff(b, c))
        else:
            after = max(after, _max_diff(a, b))
    assert 0 < own_error < 0.05 * mx.abs(c).max().item()
    assert after <= 2 * own_error, (after, own_error)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe())
def test_policy_bytes_batch_and_file_under_the_gpu_rule(shallow, policy, tmp_path):
    """Per policy, in bfloat16 with packed weights: the KV stays bfloat16, its bytes are
    the prediction after every call, two rows decoded as a batch are bit for bit each row
    alone, and a saved cache continues exactly as the one it was saved from."""
    from mlxkv.caches import copy_caches
    from mlxkv.caches.batched import merge_rows

    body, n_layers = _body(shallow), 2
    rows = [PROMPT, PROMPT[::-1]]
    singles = [make_caches(shallow.model, policy) for _ in rows]
    for ids, caches in zip(rows, singles, strict=True):
        seen = 0
        for n in (9, 1, 4):
            mx.eval(body(mx.array([ids[seen : seen + n]]), cache=caches))
            seen += n
            want = pb.allocated_bytes(policy, 3, 64, 64, 2, seen, 1)
            assert sum(c.nbytes for c in caches) == n_layers * want, (policy, seen)
    batched = merge_rows([copy_caches(c) for c in singles])
    for step in ([[7], [8]], [[9], [10]], [[11], [12]]):
        both = body(mx.array(step), cache=batched)
        for row, (t, c) in enumerate(zip(step, singles, strict=True)):
            assert mx.array_equal(both[row], body(mx.array([t]), cache=c)[0]), (policy, row)
    held = [v for _, v in tree_flatten(singles[0][0].state) if isinstance(v, mx.array)]
    assert {v.dtype for v in held if mx.issubdtype(v.dtype, mx.floating)} == {mx.bfloat16}
    meta = {"model": "shallow", "policy": policy.to_dict(), "dtype": "bfloat16"}
    save_caches(tmp_path / "c.safetensors", singles[0], meta)
    loaded = load_caches(tmp_path / "c.safetensors", meta)
    nxt = [13, 14, 15]
    assert mx.array_equal(feed(body, nxt, singles[0], [2, 1]), feed(body, nxt, loaded, [2, 1]))


def test_engine_predicts_the_bfloat16_kv_at_every_event(shallow):
    policy = KVPolicy(window=8, sinks=4, bits=4, group_size=32)
    settings = GenerationSettings(max_tokens=4, prefill_step=8)
    events = list(Session(shallow, policy).run("Two sentences about the moon.", settings))
    stats = [ev.stats for ev in events if isinstance(ev, PrefillProgress | TokenDelta | Finished)]
    assert stats and all(s.kv_bytes_actual == s.kv_bytes_predicted for s in stats)
    assert isinstance(events[-1], Finished)


def test_a_prompt_cache_from_packed_weights_is_refused_by_other_weights(shallow, tmp_path):
    from mlxkv.caches import CacheError

    session = Session(shallow)
    list(session.run("Hi", GenerationSettings(max_tokens=1)))
    session.save_cache(tmp_path / "c.safetensors")
    Session(shallow).load_cache(tmp_path / "c.safetensors")  # the same weights: taken
    plain = dataclasses.replace(shallow, packed=False)  # same dtype, dequantized weights
    with pytest.raises(CacheError, match="weights"):
        Session(plain).load_cache(tmp_path / "c.safetensors")


def test_a_biased_neighbour_leaves_a_rows_logprobs_as_they_are(shallow):
    """A row's logits processors touch its row alone: under bfloat16 the rows beside a
    biased one keep their logprobs bit for bit (a processor that turned its row to float32
    would turn the whole batch's logprobs to float32)."""
    from mlxkv.engine.scheduler import Request, Scheduler

    def run(neighbour: bool) -> list[tuple[int, float]]:
        sched = Scheduler(shallow, KVPolicy(), max_batch=2)
        plain = sched.submit(Request(PROMPT, GenerationSettings(max_tokens=4), logprobs=0))
        if neighbour:
            biased = GenerationSettings(max_tokens=4, logit_bias=((PROMPT[0], 5.0),))
            sched.submit(Request(PROMPT, biased))
        while sched.step():
            pass
        rows = sched.status()["max_rows_in_a_step"]
        assert rows == (2 if neighbour else 1)
        return [(e.token, e.logprob) for e in plain.events() if isinstance(e, TokenDelta)]

    alone = run(False)
    assert len(alone) == 4
    assert run(True) == alone


def test_embeddings_that_share_a_call_are_each_inputs_own(shallow):
    """Inputs of three lengths pooled in one right-padded call are each input's own states
    through the body alone: at the last token bit for bit (bfloat16 states, padding
    behind them), their mean to float32 summation order (the pad rows add zeros)."""
    from mlxkv.engine.events import Embedding
    from mlxkv.engine.scheduler import Request, Scheduler

    inputs = [PROMPT[:3], PROMPT, PROMPT[:9]]
    sched = Scheduler(shallow, max_batch=4)
    one = GenerationSettings(max_tokens=1)
    handles = [
        sched.submit(Request(ids, one, embed=how))
        for ids, how in zip(inputs, ("last", "mean", "last"), strict=True)
    ]
    while sched.step():
        pass
    for h, ids in zip(handles, inputs, strict=True):
        (got,) = [e.vector for e in h.events() if isinstance(e, Embedding)]
        states = _body(shallow)(mx.array(ids)[None])[0].astype(mx.float32)
        want = states.mean(axis=0) if h.request.embed == "mean" else states[-1]
        if h.request.embed == "last":
            assert got == tuple(want.tolist())
        else:
            assert _max_diff(mx.array(got), want) < 1e-5  # states up to about 21
