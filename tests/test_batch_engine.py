"""The batched decoding core against the single-sequence engine, on the default model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxkv.engine.batch import BatchRunner, Request, encode_prompt, why_not_batched
from mlxkv.engine.chat import ChatSession
from mlxkv.engine.events import Finished
from mlxkv.engine.session import GenerationSettings, Session
from mlxkv.policy import KVPolicy

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "hi",
    "Explain in two sentences why the sky is blue.",
]


def _chat_text(loaded, q):
    return loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
    )


def _single(loaded, policy, q, settings) -> Finished:
    session = ChatSession(Session(loaded, policy), settings)
    return [e for e in session.send(q) if isinstance(e, Finished)][0]


def _batched(loaded, policy, settings, batch_size, prompts=PROMPTS):
    reqs = [Request(i, _chat_text(loaded, q), settings) for i, q in enumerate(prompts)]
    results = {r.key: r for r in BatchRunner(loaded, policy, batch_size).run(reqs)}
    return [results[i] for i in range(len(prompts))]


# CI batches greedy rows against the generator under a sink + window cache (the same
# shape: batch 3, a row joining a decoding batch) in test_batch_policies.py, and the full
# cache through the server (test_serve.py, sixteen streams)
@pytest.mark.slow
def test_batched_greedy_is_token_identical_to_the_generator(default_model):
    """Batch size 3 for 5 prompts of different lengths: left padding, and prompts joining a
    batch that is already decoding (continuous batching) are both exercised."""
    settings = GenerationSettings(max_tokens=8)
    got = _batched(default_model, KVPolicy(), settings, batch_size=3)
    tok = default_model.tokenizer
    for q, r in zip(PROMPTS, got, strict=True):
        ref = _single(default_model, KVPolicy(), q, settings)
        assert r.error is None
        assert tok.encode(r.text, add_special_tokens=False) == tok.encode(
            ref.text, add_special_tokens=False
        )
        assert r.text == ref.text
        assert (r.finish_reason, r.generation_tokens, r.prompt_tokens) == (
            ref.finish_reason,
            ref.stats.generation_tokens,
            ref.stats.prompt_tokens,
        )


def test_stop_strings_cut_like_the_generator(default_model):
    settings = GenerationSettings(max_tokens=24, stop=("Paris",))
    (r,) = _batched(default_model, KVPolicy(), settings, 2, PROMPTS[:1])
    ref = _single(default_model, KVPolicy(), PROMPTS[0], settings)
    assert (r.text, r.finish_reason) == (ref.text, "stop_string")
    assert "Paris" not in r.text


def test_seeded_sampling_does_not_depend_on_batch_neighbours(default_model):
    hot = GenerationSettings(max_tokens=12, temperature=0.9, seed=11)
    text = _chat_text(default_model, PROMPTS[1])
    alone = list(BatchRunner(default_model, None, 4).run([Request(0, text, hot)]))
    others = [
        Request(i, _chat_text(default_model, q), replace(hot, seed=i))
        for i, q in enumerate(PROMPTS[2:], 1)
    ]
    crowd = BatchRunner(default_model, None, 4).run([*others, Request(0, text, hot)])
    mine = [r for r in crowd if r.key == 0]
    assert mine[0].text == alone[0].text


def test_a_batch_of_one_row_at_a_time_matches_the_session(default_model):
    """With room for one row, lines run one after another through the same loop."""
    policy = KVPolicy(window=32, sinks=4)
    assert why_not_batched(default_model, policy) is None
    assert why_not_batched(default_model, KVPolicy()) is None
    settings = GenerationSettings(max_tokens=8)
    got = _batched(default_model, policy, settings, batch_size=1, prompts=PROMPTS[:2])
    for q, r in zip(PROMPTS[:2], got, strict=True):
        ref = _single(default_model, policy, q, settings)
        assert (r.text, r.finish_reason) == (ref.text, ref.finish_reason)


def test_prompt_longer_than_the_context_is_a_per_prompt_error(default_model):
    long = "word " * 9000
    assert len(encode_prompt(default_model.tokenizer, long)) > 8192
    settings = GenerationSettings(max_tokens=4)
    ok = _chat_text(default_model, "hi")
    reqs = [Request("long", long, settings), Request("ok", ok, settings)]
    got = {r.key: r for r in BatchRunner(default_model, None, 2).run(reqs)}
    assert "context is 8192" in got["long"].error
    assert got["ok"].error is None and got["ok"].generation_tokens > 0
