"""The request scheduler on the default model: requests submitted while others decode,
cancelled alone, under different policies at once, refused with a reason, and answered
token for token as a session answers them alone."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from mlxkv.engine.chat import ChatSession
from mlxkv.engine.events import Failed, Finished, PrefillProgress, TokenDelta
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.engine.session import GenerationSettings, Session
from mlxkv.policy import KVPolicy
from tests.mlx_lm_ref import answer_penalties, eos_held, greedy_tokens

pytestmark = pytest.mark.model

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count to five."]
SINKS = KVPolicy(window=24, sinks=4)


def _ids(loaded, q):
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
    )
    return Scheduler(loaded).encode(text)


def _alone(loaded, policy, q, settings) -> Finished:
    events = ChatSession(Session(loaded, policy), settings).send(q)
    return [e for e in events if isinstance(e, Finished)][0]


def _collect(handle) -> list:
    return list(handle.events())


def test_requests_submitted_while_others_decode_join_the_batch(default_model):
    """On the scheduler's own thread: the second and third requests arrive after the first
    has produced tokens, decode in one batch with it, and each answer equals the answer
    the request gets alone."""
    settings = GenerationSettings(max_tokens=12)
    refs = [_alone(default_model, SINKS, q, settings) for q in QUESTIONS]
    sched = Scheduler(default_model, SINKS, max_batch=4)
    sched.start()
    try:
        first = sched.submit(Request(_ids(default_model, QUESTIONS[0]), settings))
        seen = []
        for ev in first.events():
            seen.append(ev)
            if isinstance(ev, TokenDelta) and len(seen) == 3:  # decoding now
                later = [
                    sched.submit(Request(_ids(default_model, q), settings)) for q in QUESTIONS[1:]
                ]
        answers = [seen[-1]] + [_collect(h)[-1] for h in later]
    finally:
        sched.close()
    status = sched.status()  # refreshed after the loop's last step
    for ans, ref in zip(answers, refs, strict=True):
        assert isinstance(ans, Finished)
        assert (ans.text, ans.finish_reason) == (ref.text, ref.finish_reason)
        assert ans.stats.generation_tokens == ref.stats.generation_tokens
    assert status["max_rows_in_a_step"] >= 2
    assert status["requests_finished"] == 3 and not status["running"]


def test_a_cancelled_request_leaves_alone_and_frees_its_row(default_model):
    settings = GenerationSettings(max_tokens=10)
    long = GenerationSettings(max_tokens=200)
    sched = Scheduler(default_model, KVPolicy(), max_batch=4)
    a = sched.submit(Request(_ids(default_model, QUESTIONS[0]), settings))
    b = sched.submit(Request(_ids(default_model, "Write a long story about a dog."), long))
    events_b = []
    for ev in b.events():  # this thread drives the loop
        events_b.append(ev)
        if sum(isinstance(e, TokenDelta) for e in events_b) == 3:
            b.cancel()
    assert events_b[-1].finish_reason == "cancelled"
    assert events_b[-1].stats.generation_tokens in (3, 4)
    rows_after_cancel = sched.status()["running"]
    assert [r["id"] for r in rows_after_cancel] == [a.id]
    final_a = _collect(a)[-1]
    ref = _alone(default_model, KVPolicy(), QUESTIONS[0], settings)
    assert (final_a.text, final_a.finish_reason) == (ref.text, ref.finish_reason)
    assert sched.idle


def test_requests_under_different_policies_are_served_together(default_model):
    """A full-cache request and a sink + window request: neither waits for the other's
    whole answer, and each answer is its policy's answer alone."""
    settings = GenerationSettings(max_tokens=10)
    sched = Scheduler(default_model, KVPolicy(), max_batch=4)
    order = []
    lock = threading.Lock()

    def sink(name):
        def put(ev):
            with lock:
                order.append((name, ev))

        return put

    q = QUESTIONS[1]
    sched.submit(Request(_ids(default_model, q), settings, sink=sink("full")))
    sched.submit(Request(_ids(default_model, q), settings, policy=SINKS, sink=sink("sinks")))
    while sched.step():
        pass
    kinds = [(n, type(e).__name__) for n, e in order if not isinstance(e, PrefillProgress)]
    first_full_end = kinds.index(("full", "Finished"))
    assert ("sinks", "TokenDelta") in kinds[:first_full_end]
    for name, policy in (("full", KVPolicy()), ("sinks", SINKS)):
        final = [e for n, e in order if n == name and isinstance(e, Finished)][0]
        ref = _alone(default_model, policy, q, settings)
        assert final.text == ref.text
        assert final.stats.policy == policy.describe()


def test_refusals_come_as_failed_events(default_model):
    sched = Scheduler(default_model)
    too_long = sched.submit(Request([1] * 9000, GenerationSettings(max_tokens=2)))
    empty = sched.submit(Request([], GenerationSettings(max_tokens=2)))
    (ev,) = _collect(too_long)
    assert isinstance(ev, Failed) and ev.code == "context_length_exceeded"
    assert "9000 tokens" in ev.message and "8192" in ev.message
    (ev,) = _collect(empty)
    assert isinstance(ev, Failed) and ev.code == "invalid_request"
    sched.close()
    with pytest.raises(Exception, match="shutting down"):
        sched.submit(Request([1, 2], GenerationSettings(max_tokens=2)))


def test_logprobs_follow_the_chosen_token(default_model):
    sched = Scheduler(default_model)
    h = sched.submit(
        Request(_ids(default_model, QUESTIONS[0]), GenerationSettings(max_tokens=4), logprobs=3)
    )
    deltas = [e for e in _collect(h) if isinstance(e, TokenDelta) and e.token >= 0]
    assert deltas
    for d in deltas:
        assert len(d.top_logprobs) == 3
        best_token, best_lp = d.top_logprobs[0]
        assert best_token == d.token  # greedy: the best alternative is the one chosen
        assert d.logprob == pytest.approx(best_lp) and d.logprob <= 0
        assert d.top_logprobs[1][1] <= best_lp


def test_penalties_and_logit_bias_give_mlx_lms_tokens_in_a_batch(default_model):
    """Repetition penalty as mlx-lm applies it (the last 20 tokens, prompt included);
    presence and frequency penalties over the answer alone; logit_bias added. Each row of
    a batch of three gets the tokens of mlx-lm's generate_step with the same processors,
    and the penalties change the plain greedy answer."""
    from mlx_lm.sample_utils import make_logits_processors

    n = 16
    ids = _ids(default_model, "Write a poem about the sea, the sea, the sea.")
    comma = default_model.tokenizer.encode(",")[-1]
    asked = {
        "plain": (GenerationSettings(max_tokens=n), []),
        "repetition": (
            GenerationSettings(max_tokens=n, repetition_penalty=1.5),
            make_logits_processors(repetition_penalty=1.5),
        ),
        "openai": (
            GenerationSettings(
                max_tokens=n,
                presence_penalty=0.8,
                frequency_penalty=0.6,
                logit_bias=((comma, -100.0),),
            ),
            [answer_penalties(len(ids), 0.8, 0.6, {comma: -100.0})],
        ),
    }
    sched = Scheduler(default_model, KVPolicy(), max_batch=4)
    handles = {k: sched.submit(Request(ids, s)) for k, (s, _) in asked.items()}
    while sched.step():
        pass
    got = {
        k: [e.token for e in _collect(h) if isinstance(e, TokenDelta) and e.token >= 0]
        for k, h in handles.items()
    }
    assert sched.status()["max_rows_in_a_step"] == 3
    for name, (_, processors) in asked.items():
        ref = greedy_tokens(default_model, ids, n, processors)
        assert got[name] == ref[: len(got[name])] and len(got[name]) in (len(ref), n), name
    assert got["repetition"] != got["plain"] and got["openai"] != got["plain"]
    assert comma in got["plain"] and comma not in got["openai"]


def _run(sched, asked: dict) -> dict:
    """Each request of ``asked`` (name: (ids, settings)) answered in one batch: name ->
    (tokens, Finished)."""
    handles = {k: sched.submit(Request(ids, s)) for k, (ids, s) in asked.items()}
    while sched.step():
        pass
    out = {}
    for k, h in handles.items():
        events = _collect(h)
        tokens = [e.token for e in events if isinstance(e, TokenDelta) and e.token >= 0]
        out[k] = tokens, [e for e in events if isinstance(e, Finished)][0]
    return out


def test_min_tokens_and_ignore_eos_hold_the_end_back(default_model):
    """EOS held back for the answer's first min_tokens tokens (vLLM's min_tokens) or for
    good (ignore_eos): in one batch each row gets the tokens of mlx-lm's generate_step with
    EOS masked as long, where the plain answer ends at its ninth token. A stop string
    counts only once it ends after the text of the first min_tokens - 1 tokens."""
    tok = default_model.tokenizer
    eos = tok.eos_token_ids
    sky = _ids(default_model, "Reply with one word: is the sky blue?")
    hi = _ids(default_model, "Say hi.")
    stops = ("!", ".")
    asked = {
        "plain": (sky, GenerationSettings(max_tokens=18)),
        "min 14": (sky, GenerationSettings(max_tokens=24, min_tokens=14)),
        "ignore_eos": (sky, GenerationSettings(max_tokens=18, ignore_eos=True)),
        "stop": (hi, GenerationSettings(max_tokens=18, stop=stops)),
        "stop, min 8": (hi, GenerationSettings(max_tokens=18, stop=stops, min_tokens=8)),
    }
    got = _run(Scheduler(default_model, KVPolicy(), max_batch=8), asked)
    refs = {
        "plain": greedy_tokens(default_model, sky, 18, [], eos),
        "min 14": greedy_tokens(default_model, sky, 24, [eos_held(len(sky), eos, 14)], eos),
        "ignore_eos": greedy_tokens(default_model, sky, 18, [eos_held(len(sky), eos, None)]),
    }
    for name, ref in refs.items():  # (the reference keeps the EOS it stops at)
        assert got[name][0] == [t for t in ref if t not in eos], name
    assert len(refs["plain"]) == 9 and refs["plain"][-1] in eos
    assert got["plain"][1].finish_reason == got["min 14"][1].finish_reason == "stop"
    assert len(refs["min 14"]) > 14 and not set(refs["min 14"][:14]) & set(eos)
    assert got["ignore_eos"][1].finish_reason == "length" and not set(refs["ignore_eos"]) & eos
    assert got["ignore_eos"][1].text.startswith("The sky is indeed a brilliant blue.")
    assert got["stop"][1].text == "Hello there"
    assert got["stop, min 8"][1].text == (
        "Hello there! I'm here to help with any kind of creative writing project"
    )
    assert got["stop, min 8"][1].stop == "."


def test_a_schema_ends_the_answer_whatever_holds_eos_back(default_model):
    """A run-wide --ignore-eos or --min-tokens (a server's, a batch's) yields to an answer
    held to a schema: it ends where the schema does, at its EOS."""
    from mlxkv.engine.grammar import json_grammar

    ids = _ids(default_model, "Is the sky blue? Answer true or false.")
    held = {"max_tokens": 12, "grammar": json_grammar({"type": "boolean"})}
    asked = {
        "ignore_eos": (ids, GenerationSettings(ignore_eos=True, **held)),
        "min_tokens": (ids, GenerationSettings(min_tokens=8, **held)),
    }
    got = _run(Scheduler(default_model, KVPolicy(), max_batch=4), asked)
    for name, (_, finished) in got.items():
        assert finished.finish_reason == "stop" and finished.text in ("true", "false"), name


def test_xtc_drops_the_top_choices_as_mlx_lms_sampler_does(default_model):
    """XTC with probability 1 (mlx_lm.server's xtc_probability and xtc_threshold): at a
    temperature near 0, seeded or not, each step picks the most likely token XTC leaves,
    mlx-lm's apply_xtc then argmax; without XTC the answer is the greedy one."""
    from mlx_lm.sample_utils import apply_xtc

    from mlxkv.engine.samplers import xtc_exempt

    tok = default_model.tokenizer
    ids = _ids(default_model, "Name three colours.")
    exempt = xtc_exempt(tok)
    assert exempt == [tok.encode("\n", add_special_tokens=False)[0], *sorted(tok.eos_token_ids)]
    xtc = {"temperature": 1e-6, "xtc_probability": 1.0, "xtc_threshold": 0.1, "max_tokens": 10}
    asked = {
        "seeded": (ids, GenerationSettings(seed=7, **xtc)),
        "unseeded": (ids, GenerationSettings(**xtc)),
        "plain": (ids, GenerationSettings(temperature=1e-6, max_tokens=10)),
    }
    got = _run(Scheduler(default_model, KVPolicy(), max_batch=4), asked)
    ref = greedy_tokens(
        default_model, ids, 10, [lambda _, x: apply_xtc(x, 1.0, 0.1, exempt)], tok.eos_token_ids
    )
    plain = greedy_tokens(default_model, ids, 10, [], tok.eos_token_ids)
    assert got["seeded"][0] == got["unseeded"][0] == [t for t in ref if t not in exempt[1:]]
    assert got["plain"][0] == [t for t in plain if t not in exempt[1:]] != got["seeded"][0]


def _active_mib() -> float:
    import gc

    import mlx.core as mx

    gc.collect()
    return mx.get_active_memory() / 2**20


def test_rows_in_a_batch_hold_the_batch_caches_only(default_model):
    """A request that joins a batch lets its own caches go (the batch holds copies): the
    memory held while four rows decode is the batch's, not twice it."""
    settings = GenerationSettings(max_tokens=24)
    sched = Scheduler(default_model, KVPolicy(), max_batch=4, share_prefix=False)
    before = _active_mib()
    stories = [f"Write a long story about a {a}." for a in ("dog", "cat", "bird", "fish")]
    handles = [sched.submit(Request(_ids(default_model, q), settings)) for q in stories]
    held = batch = None
    for ev in handles[0].events():  # this thread drives the loop
        if isinstance(ev, TokenDelta) and ev.stats.generation_tokens == 12:
            rows = sched.status()["running"]
            assert len(rows) == 4 and {r["batch_rows"] for r in rows} == {4}
            held, batch = _active_mib() - before, ev.stats.kv_bytes_actual / 2**20
    for h in handles[1:]:
        _collect(h)
    assert batch == 4 * 11.25  # four rows of 256 slots x 46,080 bytes
    assert held < batch + 8, (held, batch)  # the single caches too would be 2 x 45 MiB


def test_a_policy_per_request_pins_no_memory(default_model):
    """Requests under policies never seen before, one after another: once each has ended
    the scheduler holds no KV for it (a policy's shared-prefix slot held the first
    request's caches for the server's lifetime)."""
    settings = GenerationSettings(max_tokens=4)
    sched = Scheduler(default_model, KVPolicy())
    ids = _ids(default_model, QUESTIONS[0])
    _collect(sched.submit(Request(ids, settings)))  # warm: MLX's own first-use buffers
    before = _active_mib()
    for window in range(300, 304):
        policy = KVPolicy(window=window, sinks=4)
        assert isinstance(
            _collect(sched.submit(Request(ids, settings, policy=policy)))[-1], Finished
        )
    assert _active_mib() - before < 1, _active_mib() - before


def test_an_open_ended_answer_reserves_its_memory_step_by_step(default_model):
    """An answer with no limit of its own (OpenAI's default) reserves ``reserve_step``
    tokens at a time: with no budget it runs past its first step to its cap; under a
    budget it grows while the budget has room and ends ("length") where it has none, its
    tokens those of an unlimited greedy answer up to there."""
    from mlxkv.engine.admission import MemoryBudget

    # greedy counting has no early EOS; 227 tokens, near the 256 at which the KV grows
    ids = Scheduler(default_model).encode(", ".join(str(i) for i in range(1, 60)) + ",")
    step, cap = 8, 20
    open_ended = GenerationSettings(max_tokens=cap, open_ended=True)
    sched = Scheduler(default_model, KVPolicy(), reserve_step=step)
    free = sched.submit(Request(ids, open_ended))
    while sched.step():
        pass
    done = _collect(free)[-1]
    assert done.stats.finish_reason == "length" and done.stats.generation_tokens == cap

    probe = MemoryBudget(default_model, None, 4, 512)
    room = probe.reservation(KVPolicy(), 256)  # the KV of 256 tokens, not of 257
    fits = max(k for k in range(9) if probe.reservation(KVPolicy(), len(ids) + k * step) <= room)
    assert fits * step < 256 - len(ids) < (fits + 1) * step
    memory = MemoryBudget(default_model, probe.base() + room, 4, 512)
    sched = Scheduler(default_model, KVPolicy(), memory=memory, reserve_step=step)
    held = sched.submit(Request(ids, replace(open_ended, max_tokens=4096)))
    while sched.step():
        pass
    events = _collect(held)
    done = events[-1]
    assert isinstance(done, Finished) and done.stats.finish_reason == "length"
    assert done.stats.generation_tokens == fits * step
    tokens = [e.token for e in events if isinstance(e, TokenDelta)]
    assert tokens == greedy_tokens(default_model, ids, fits * step, [])
