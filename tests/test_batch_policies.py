"""Batched window, sink and quantized caches against their single-sequence forms.

Unit level: rows prefilled alone, merged, decoded together, leaving and joining, must hold
bit for bit what each row's own single cache holds (same slots, same sink rotation, same
positions, same rebases), and allocate what the memory model predicts. Model level: greedy
batched output is token-identical to the engine's ``Session`` under each policy.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.caches import cache_for, copy_caches
from mlxkv.caches import storage as st
from mlxkv.caches.batched import BatchedKVCache, QuantizedBatchedKVCache
from mlxkv.caches.rotation import Rotation
from mlxkv.memory.predictor import batch_allocated
from mlxkv.policy import KVPolicy
from tests.kv_rows import prefill_random, random_kv

H, D = 3, 64
ROT = Rotation(D, False, 100000.0, 1.0)
POLICIES = [
    KVPolicy(),
    KVPolicy(window=16, sinks=4),
    KVPolicy(window=16),
    KVPolicy(bits=4, key_scheme="rotated"),  # KIVI rows: tests/test_batch_kivi.py
    KVPolicy(window=16, sinks=4, bits=4, key_scheme="rotated"),
]


def _single(policy, rebase_every=None):
    return cache_for(policy, ROT, rebase_every=rebase_every)


def _kv(n, seed):
    return random_kv(n, seed, H, D)


def _prefill(c, n, seed):
    return prefill_random(c, n, seed, H, D)


def _same(batched_part, single_part):
    parts_b = batched_part if isinstance(batched_part, tuple) else (batched_part,)
    parts_s = single_part if isinstance(single_part, tuple) else (single_part,)
    return all(mx.array_equal(a, b).item() for a, b in zip(parts_b, parts_s, strict=True))


def _row(s, b):
    return tuple(x[b : b + 1] for x in s) if isinstance(s, tuple) else s[b : b + 1]


def _check_rows(batched, singles):
    for b, s in enumerate(singles):
        assert batched.n[b] == s.tokens_seen
        assert batched.offset[b].item() == s.offset
        held = st.tokens_of(s.keys)
        row_k = st.take(_row(batched.keys, b), 0, held)
        row_v = st.take(_row(batched.values, b), 0, held)
        assert _same(row_k, s.keys), f"row {b} keys differ"
        assert _same(row_v, s.values), f"row {b} values differ"


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe())
def test_rows_decode_leave_and_join_bit_for_bit(policy):
    """Three rows at different positions (one still filling, two evicting), decode steps,
    a row leaving, a new row joining mid-batch, an empty row joining; rebases every 8."""
    lengths = [5, 23, 40]
    singles = [_prefill(_single(policy, 8), n, i) for i, n in enumerate(lengths)]
    batched = BatchedKVCache.merge(copy_caches(singles))
    seed = 100
    for step in range(30):
        if step == 10:  # row 1 finishes
            del singles[1]
            batched.filter([0, 1 + 1])
        if step == 15:  # a long prompt joins, and a one-token one (nothing prefilled)
            joining = [_prefill(_single(policy, 8), 31, 7), _single(policy, 8)]
            singles += joining
            batched.extend_rows(copy_caches(joining))
        ks, vs = zip(*(_kv(1, seed + b) for b in range(len(singles))), strict=True)
        seed += 10
        mask = batched.make_mask(1)
        out_k, _ = batched.update_and_fetch(mx.concatenate(ks), mx.concatenate(vs))
        for s, k, v in zip(singles, ks, vs, strict=True):
            s.update_and_fetch(k, v)
        _check_rows(batched, singles)
        if mask is not None:  # each row sees exactly the slots its single cache holds
            held = [min(s.tokens_seen, getattr(s, "limit", None) or s.tokens_seen) for s in singles]
            assert mask[:, 0, 0, :].sum(axis=1).tolist() == held
        width = max(min(n, batched.limit or n) for n in batched.n)
        if isinstance(batched, QuantizedBatchedKVCache):  # whole buffers, the tail masked
            assert st.tokens_of(out_k) == st.tokens_of(batched.keys) and batched.held == width
        else:
            assert st.tokens_of(out_k) == width
        assert st.tokens_of(batched.keys) == st.capacity(max(batched.n), batched.limit)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe())
def test_batched_bytes_equal_the_prediction(policy, default_model):
    from mlxkv.memory import layout_for

    layout = layout_for(default_model.config)
    singles = [_prefill(_single(policy), n, i) for i, n in enumerate([3, 300, 41])]
    layers = len(default_model.model.layers)
    rows = [copy_caches(singles) for _ in range(layers)]
    caches = [BatchedKVCache.merge(r) for r in rows]
    for _ in range(3):
        k, v = _kv(3, 5)
        for c in caches:
            c.update_and_fetch(k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3))
        actual = sum(c.nbytes for c in caches)
        assert actual == batch_allocated(layout, policy, caches[0].n, "float32")
    caches[0].filter([0, 2])
    for c in caches[1:]:
        c.filter([0, 2])
    assert sum(c.nbytes for c in caches) == batch_allocated(layout, policy, caches[0].n)


# -- on the default model: token identity with the single-sequence engine ---------------------
PROMPTS = [
    "What is the capital of France?",  # finishes early (EOS)
    "Write a haiku about the sea.",
    "hi",
    "Explain in two sentences why the sky is blue.",  # joins when a row leaves
]


def _chat_text(loaded, q):
    return loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.model
@pytest.mark.parametrize(
    "policy",
    [
        KVPolicy(window=16, sinks=4),
        pytest.param(KVPolicy(bits=4), marks=pytest.mark.slow),  # CPU quantized matmul: slow
        pytest.param(KVPolicy(window=16, sinks=4, bits=4), marks=pytest.mark.slow),
    ],
    ids=lambda p: p.describe(),
)
def test_greedy_batched_is_token_identical_to_the_generator(default_model, policy):
    """Batch size 3 for 4 prompts of different lengths (31 to 40 tokens, so a 4 + 16 window
    evicts during prefill and decode): rows finish at different times and the fourth prompt
    joins a batch that is already decoding."""
    from mlxkv.engine.batch import BatchRunner, Request
    from mlxkv.engine.chat import ChatSession
    from mlxkv.engine.events import Finished
    from mlxkv.engine.session import GenerationSettings, Session

    settings = GenerationSettings(max_tokens=12)
    reqs = [Request(i, _chat_text(default_model, q), settings) for i, q in enumerate(PROMPTS)]
    runner = BatchRunner(default_model, policy, 3, check_kv=True)
    assert runner.batched
    got = {r.key: r for r in runner.run(reqs)}
    tok = default_model.tokenizer
    reasons = set()
    for i, q in enumerate(PROMPTS):
        session = ChatSession(Session(default_model, policy), settings)
        ref = [e for e in session.send(q) if isinstance(e, Finished)][0]
        r = got[i]
        assert r.error is None
        assert tok.encode(r.text, add_special_tokens=False) == tok.encode(
            ref.text, add_special_tokens=False
        )
        assert (r.finish_reason, r.generation_tokens, r.prompt_tokens) == (
            ref.finish_reason,
            ref.stats.generation_tokens,
            ref.stats.prompt_tokens,
        )
        reasons.add(r.finish_reason)
    assert reasons == {"stop", "length"}  # rows left at different steps
    kv = runner.kv_summary()
    assert kv["kv_steps_checked"] > 0 and kv["kv_steps_mismatched"] == 0
    assert kv["kv_bytes_actual_peak"] == kv["kv_bytes_predicted_peak"] > 0


# plan takes --kv-bits (the default KIVI keys): the unquantized policies and KIVI batches
PLANNED = POLICIES[:3] + [KVPolicy(bits=4), KVPolicy(window=16, sinks=4, bits=4)]


@pytest.mark.parametrize("policy", PLANNED, ids=lambda p: p.describe())
def test_plan_batch_predicts_the_batched_allocation(policy, default_model, capsys):
    """``mlxkv plan --batch 3 --context 300`` with a policy == the nbytes of a batch of three
    rows at 300 tokens (every layer of the default model: 3 KV heads of 64)."""
    import json

    from mlxkv.cli import main

    layers = len(default_model.model.layers)
    singles = [_prefill(_single(policy), 299, i) for i in range(3)]
    caches = [BatchedKVCache.merge(copy_caches(singles)) for _ in range(layers)]
    k, v = _kv(3, 9)
    for c in caches:  # the 300th token of each row, as a decode step
        c.update_and_fetch(k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3))
    argv = ["plan", str(default_model.path), "--batch", "3", "--context", "300"]
    argv += ["--kv-dtype", "float32", "--json"]
    for flag, value in (("--kv-window", policy.window), ("--kv-bits", policy.bits)):
        if value is not None:
            argv += [flag, str(value)]
    if policy.window is not None:
        argv += ["--kv-sinks", str(policy.sinks)]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_allocated"] == sum(c.nbytes for c in caches)


DOCUMENT = (
    "The lighthouse at Carrow Point was built in 1871 from granite quarried on the island. "
    "Its lamp burned whale oil until 1904, then kerosene, and it was electrified in 1952. "
    "Three keepers lived there at a time; the last of them left in 1989 when the light "
    "became automatic. Today the keepers' cottage is a small museum about the wrecks."
)
QUESTIONS = ["When was it built?", "What did the lamp burn?", "When did the last keeper leave?"]


@pytest.mark.model
@pytest.mark.parametrize(
    "policy",
    # the full cache's shared prefix also runs in CI through the server (test_serve_prefix)
    [pytest.param(KVPolicy(), marks=pytest.mark.slow), KVPolicy(window=48, sinks=4)],
    ids=str,
)
def test_shared_prefix_is_prefilled_once_with_the_same_answers(default_model, policy):
    """Three questions about one document, batch size 2 (the third joins later): the
    document is prefilled once, and every answer is the Session's."""
    from mlxkv.engine.batch import BatchRunner, Request
    from mlxkv.engine.chat import ChatSession
    from mlxkv.engine.events import Finished
    from mlxkv.engine.session import GenerationSettings, Session

    settings = GenerationSettings(max_tokens=8)
    asks = [f"{DOCUMENT}\n\n{q}" for q in QUESTIONS]
    reqs = [Request(i, _chat_text(default_model, q), settings) for i, q in enumerate(asks)]
    runner = BatchRunner(default_model, policy, 2, check_kv=True)
    got = {r.key: r for r in runner.run(reqs)}
    assert runner.prefixes.hits == 3
    assert runner.prefixes.prefilled_tokens > 64  # the template's head and the document
    # as each request's usage counts them: prefilled + cached = prompt tokens
    sched = runner.scheduler
    total = sum(r.prompt_tokens for r in got.values())
    assert sched.prompt_tokens_prefilled + sched.prompt_tokens_cached == total
    for i, q in enumerate(asks):
        session = ChatSession(Session(default_model, runner.policy), settings)
        ref = [e for e in session.send(q) if isinstance(e, Finished)][0]
        assert (got[i].text, got[i].finish_reason) == (ref.text, ref.finish_reason)
