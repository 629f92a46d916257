"""The engine on the default model: cache reuse across turns, cancel, regenerate, stop
strings, seeds, and predicted == actual KV bytes at every event for every policy."""

from __future__ import annotations

import pytest

from mlxkv.engine.chat import ChatSession
from mlxkv.engine.events import Finished, PrefillProgress, TokenDelta
from mlxkv.engine.session import GenerationSettings, Session
from mlxkv.errors import UserError
from mlxkv.policy import KVPolicy

pytestmark = pytest.mark.model

GREEDY = GenerationSettings(max_tokens=12, temperature=0.0)


def finish(events) -> Finished:
    *_, last = list(events)
    assert isinstance(last, Finished)
    return last


def test_second_turn_prefills_only_its_new_tokens(default_model):
    chat = ChatSession(Session(default_model), GREEDY)
    first = finish(chat.send("What is the capital of France?"))
    cached = chat.generator.cached_tokens
    assert cached == first.stats.prompt_tokens + first.stats.generation_tokens
    second = finish(chat.send("And of Italy?"))
    s = second.stats
    assert s.prompt_tokens_cached == cached  # the whole first exchange is reused
    assert s.prompt_tokens - s.prompt_tokens_cached < 20  # the new user turn and template
    assert s.kv_tokens_seen == s.prompt_tokens + s.generation_tokens


def test_reused_cache_gives_the_same_answer_as_a_fresh_one(default_model):
    chat = ChatSession(Session(default_model), GREEDY)
    finish(chat.send("Name a fruit."))
    reused = finish(chat.send("Name a colour."))
    fresh = Session(default_model)
    again = finish(fresh.run(chat.generator.loaded.tokenizer.apply_chat_template(
        chat.messages[:-1], tokenize=False, add_generation_prompt=True), GREEDY))  # fmt: skip
    assert again.text == reused.text


def test_cancel_keeps_the_cut_answer_and_the_next_turn_works(default_model):
    chat = ChatSession(Session(default_model), GenerationSettings(max_tokens=200))
    seen = 0
    events = chat.send("Write a long poem about the sea.")
    for ev in events:
        if isinstance(ev, TokenDelta):
            seen += 1
            if seen == 5:
                chat.cancel()
        if isinstance(ev, Finished):
            cut = ev
    assert cut.finish_reason == "cancelled"
    assert cut.stats.generation_tokens == 5
    assert chat.messages[-1] == {"role": "assistant", "content": cut.text}
    nxt = finish(chat.send("What is 2+2?"))
    assert nxt.finish_reason in ("stop", "length")
    assert nxt.stats.kv_bytes_actual == nxt.stats.kv_bytes_predicted


def test_regenerate_replaces_the_last_answer(default_model):
    chat = ChatSession(Session(default_model), GREEDY)
    a = finish(chat.send("What is the capital of France?"))
    b = finish(chat.regenerate())
    assert b.text == a.text  # greedy: the same answer again
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert b.stats.kv_bytes_actual == b.stats.kv_bytes_predicted


def test_regenerate_before_any_message_is_refused(default_model):
    chat = ChatSession(Session(default_model), GREEDY)
    with pytest.raises(UserError, match="nothing to regenerate"):
        list(chat.regenerate())


def test_stop_string_cuts_the_answer(default_model):
    gen = Session(default_model)
    settings = GenerationSettings(max_tokens=40, stop=("rather a city",), continues=True)
    out = finish(gen.run("The capital of France is Paris. The capital of France is", settings))
    assert out.finish_reason == "stop_string"
    assert out.text == " not a country, but "  # "... France is" + " not a country"
    streamed = ""
    for ev in Session(default_model).run(
        "The capital of France is Paris. The capital of France is", settings
    ):
        if isinstance(ev, TokenDelta):
            streamed += ev.text
    assert streamed == out.text


def test_seed_makes_sampling_repeatable(default_model):
    s = GenerationSettings(max_tokens=10, temperature=1.0, seed=7)
    a = finish(Session(default_model).run("Once upon a time", s)).text
    b = finish(Session(default_model).run("Once upon a time", s)).text
    c = finish(Session(default_model).run("Once upon a time", GenerationSettings(
        max_tokens=10, temperature=1.0, seed=8))).text  # fmt: skip
    assert a == b and a != c


def test_empty_message_is_refused_and_not_kept(default_model):
    chat = ChatSession(Session(default_model), GREEDY)
    with pytest.raises(UserError, match="empty"):
        list(chat.send("  "))
    assert chat.messages == []


def test_context_overflow_stop_or_slide(default_model, monkeypatch):
    monkeypatch.setitem(default_model.config, "max_position_embeddings", 120)
    try:
        chat = ChatSession(Session(default_model, overflow="stop"), GREEDY)
        long = "Tell me about " + "the sea, " * 60
        with pytest.raises(UserError, match="model's context is 120"):
            list(chat.send(long))
        assert chat.messages == []  # nothing half-kept
        slide = ChatSession(Session(default_model, overflow="slide"), GREEDY)
        out = finish(slide.send(long))
        assert slide.generator.policy.window is not None
        assert out.stats.kv_bytes_actual == out.stats.kv_bytes_predicted
    finally:
        default_model.config["max_position_embeddings"] = 8192


POLICIES = [
    KVPolicy(),
    # the bare window is the sink cache's code with no sinks: its bytes on the default
    # model run in CI in test_batch_policies.py
    pytest.param(KVPolicy(window=48, sinks=0), marks=pytest.mark.slow),
    # the sink + window and the 4-bit caches: the sink + window + 4-bit row runs both codes
    # in CI (the 4-bit alone in group 32 also in tests/test_gpu_dtype.py)
    pytest.param(KVPolicy(window=48, sinks=4), marks=pytest.mark.slow),
    # 8-bit follows the 4-bit code path with other widths; its bytes per step on the default
    # model: test_caches_model.py::test_default_model_exact_bytes, test_caches_memory.py
    pytest.param(KVPolicy(bits=8), marks=pytest.mark.slow),
    pytest.param(KVPolicy(bits=4, group_size=32), marks=pytest.mark.slow),
    KVPolicy(window=48, sinks=4, bits=4),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe())
def test_predicted_equals_actual_at_every_event(default_model, policy):
    chat = ChatSession(
        Session(default_model, policy), GenerationSettings(max_tokens=16, prefill_step=16)
    )
    for text in ("Write two sentences about the moon.", "Now about the sun."):
        n = 0
        for ev in chat.send(text):
            if isinstance(ev, TokenDelta | Finished):
                s = ev.stats
                assert s.kv_bytes_actual == s.kv_bytes_predicted, (n, s)
                n += 1
            elif isinstance(ev, PrefillProgress):
                assert ev.stats.kv_bytes_actual == ev.stats.kv_bytes_predicted
        if policy.window is not None:
            assert s.kv_tokens <= policy.window + policy.sinks


def test_walking_away_between_tokens_keeps_a_consistent_cache(default_model):
    gen = Session(default_model)
    finish(gen.run("Hello there.", GREEDY))
    events = gen.run("Hello there. How are you?", GenerationSettings(max_tokens=50))
    for ev in events:
        if isinstance(ev, TokenDelta):
            break  # the caller walks away mid-answer
    events.close()
    held = len(gen.tokens)
    assert held > 0 and all(c.tokens_seen == held for c in gen.caches)
    out = finish(gen.run("Hello there.", GREEDY))
    assert out.stats.prompt_tokens_cached == out.stats.prompt_tokens - 1
    assert out.stats.kv_bytes_actual == out.stats.kv_bytes_predicted


def test_a_model_failure_rebuilds_the_cache_and_the_next_turn_works(default_model, monkeypatch):
    gen = Session(default_model)
    finish(gen.run("Hello there.", GREEDY))
    layer = default_model.model.layers[7]
    calls = {"n": 0}
    real = type(layer).__call__

    def broken(self, *args, **kwargs):
        if self is layer:
            calls["n"] += 1
            raise RuntimeError("the accelerator went away")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(layer), "__call__", broken)
    with pytest.raises(RuntimeError, match="went away"):
        finish(gen.run("Hello there. How are you? " * 3, GREEDY))
    monkeypatch.undo()
    assert calls["n"] == 1 and gen.tokens == [] and gen.kv.actual_bytes() == 0
    out = finish(gen.run("Hello there.", GREEDY))
    assert out.stats.prompt_tokens_cached == 0
    assert out.stats.kv_bytes_actual == out.stats.kv_bytes_predicted


def test_cancel_before_the_turn_starts_is_honoured(default_model):
    gen = Session(default_model)
    gen.cancel()
    out = finish(gen.run("Write a long poem about the sea.", GenerationSettings(max_tokens=50)))
    assert out.finish_reason == "cancelled" and out.stats.generation_tokens <= 1
    again = finish(gen.run("Hi", GenerationSettings(max_tokens=3)))
    assert again.finish_reason != "cancelled"


def test_a_character_cut_short_is_left_out_only_at_a_cut(default_model_path):
    """Two CJK characters of three tokens each, the last token not given: an answer cut
    there (a limit, a cancel) ends with the first character; one the model ended (EOS)
    keeps what its bytes make, a replacement character."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxkv.engine.finish import FinishRule

    tok = load_tokenizer(default_model_path)
    ids = tok.encode("猫猫", add_special_tokens=False)
    assert len(ids) == 6
    for reason, text in (("length", "猫"), ("cancelled", "猫"), ("stop", "猫\ufffd")):
        rule, shown = FinishRule(tok, (), 100), ""
        for t in ids[:-1]:
            shown += rule.add(t)[0]
        rule.reason = "stop" if reason == "stop" else None  # as an EOS token sets it
        rest, whole = rule.end(None if reason == "stop" else reason)
        assert (whole, shown + rest) == (text, text)
