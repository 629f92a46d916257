"""Drafts from the conversation (prompt lookup decoding): the index, the caches' promise
to give rejected drafts back exactly, and greedy answers on the real model that are the
plain answers token for token while taking several tokens a step."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxkv.caches import CacheError, make_caches, trim_caches, trimmable, trimmable_after
from mlxkv.engine.chat import ChatSession
from mlxkv.engine.events import Finished, TokenDelta
from mlxkv.engine.lookup import PromptLookup, adapt_draft_length
from mlxkv.engine.prefix_cache import PrefixCache
from mlxkv.engine.request import GenerationSettings
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.engine.session import Session
from mlxkv.memory import policy_bytes as pb
from mlxkv.policy import KVPolicy
from tests._caches_ref import feed
from tests.memory_watch import worst_beyond_counted
from tests.mlx_lm_ref import greedy_tokens
from tests.tiny_models import tiny_llama

PASSAGE = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered as the rightful property of "
    "some one or other of their daughters."
)
COPY = f"Copy this passage word for word:\n\n{PASSAGE}"


# -- the index ---------------------------------------------------------------------------
def test_a_draft_is_what_followed_the_latest_longest_match():
    look = PromptLookup([7, 1, 2, 3, 4, 8, 1, 2, 5, 6, 9, 1, 2])
    # "1 2" last occurred before "5 6"; no earlier "9 1 2", so the 2-gram decides
    assert look.draft(3) == [5, 6, 9]
    # a 3-gram beats a later 2-gram: "8 1 2" only ever came before "5"
    look = PromptLookup([8, 1, 2, 5, 0, 1, 2, 7, 8, 1, 2])
    assert look.draft(2) == [5, 0]


def test_a_lone_shared_token_drafts_nothing_and_a_draft_stops_at_the_end():
    look = PromptLookup([4, 5, 6, 4])
    assert look.draft(4) == []  # "4" alone is too weak a sign (NGRAM_MIN 2)
    look = PromptLookup([4, 5, 6, 4, 5])
    assert look.draft(8) == [6, 4, 5]  # what exists after the match, no more


def test_the_pending_token_is_part_of_the_match_and_of_the_draft():
    look = PromptLookup([3, 1, 2, 9, 3, 1])
    assert look.draft(3, (2,)) == [9, 3, 1]
    assert look.draft(6, (2,)) == [9, 3, 1, 2]  # runs on into the pending token
    look.follow([2, 9])  # answer tokens join as they are shown
    look.follow([2, 9])  # (again: nothing new)
    assert look.tokens == [3, 1, 2, 9, 3, 1, 2, 9]
    assert look.draft(2) == [3, 1]
    assert look.draft(0) == []


def test_a_predicted_output_drafts_ahead_of_the_prompt_until_the_answer_repeats_itself():
    look = PromptLookup([1, 2, 3, 4, 1, 2], hint=[1, 2, 9, 9, 7])
    assert look.draft(3) == [9, 9, 7]  # the hint's "1 2" wins over the prompt's
    look.follow([9])
    assert look.draft(3) == [9, 7]  # "2 9" is only in the hint
    assert look.tokens == [1, 2, 3, 4, 1, 2, 9]  # the hint is never what was said last
    look.follow([9, 5, 1, 2, 8])
    assert look.draft(2, (1, 2)) == [8, 1]  # the answer's own "1 2" is the latest


def test_the_draft_length_grows_while_drafts_are_taken_and_shrinks_when_not():
    assert adapt_draft_length(4, 4, 4, 8) == 6
    assert adapt_draft_length(7, 7, 7, 8) == 8
    assert adapt_draft_length(4, 2, 4, 8) == 3
    assert adapt_draft_length(1, 0, 1, 8) == 1


# -- the caches' promise ----------------------------------------------------------------
POLICIES = [
    (KVPolicy(), 0),
    (KVPolicy(window=12, sinks=4), 0),
    (KVPolicy(window=12, sinks=4), 6),
    (KVPolicy(window=12, sinks=4, bits=8, group_size=32, key_scheme="rotated"), 6),
    (KVPolicy(key_bits=4, group_size=32), 0),
    (KVPolicy(window=24, sinks=4, key_bits=4, group_size=32), 0),
]
A = [(7 * i + 3) % 64 for i in range(60)]


@pytest.mark.parametrize("policy,reserve", POLICIES, ids=lambda p: str(p))
@pytest.mark.parametrize("before", [3, 11, 15, 30, 35])
def test_what_trimmable_after_promises_an_update_gives_back_exactly(policy, reserve, before):
    """Feed ``before`` tokens, ask how many of a 5-token update could be taken back, feed
    it, take back that many (at most 4, as a step of 4 drafts does), then 3 more tokens:
    the logits are an uncached run's over the tokens kept."""
    model = tiny_llama(layers=2)
    caches = make_caches(model, policy, reserve=reserve)
    feed(model, A[:before], caches, [before])
    promise = trimmable_after(caches, 5)
    feed(model, A[before : before + 5], caches, [5])
    assert min(trimmable(c) for c in caches) >= promise
    back = min(promise, 4)
    trim_caches(caches, back)
    kept = before + 5 - back
    rest = [1, 2, 3]
    got = feed(model, rest, caches, [1, 1, 1])
    fresh = feed(model, A[:kept] + rest, make_caches(model, policy), [kept, 1, 1, 1])
    assert mx.abs(got - fresh[:, kept:]).max().item() < 1e-4
    if policy.window is None and policy.key_bits is None:
        assert promise == before + 5  # a full cache gives everything back
    if reserve:
        assert promise >= 5  # an undo log covers the update, evicting or not


def test_trimmable_after_for_mlx_lms_own_caches():
    k = mx.zeros((1, 2, 6, 8))
    plain, rotating, state = KVCache(), RotatingKVCache(max_size=10), ArraysCache(2)
    plain.update_and_fetch(k, k)
    rotating.update_and_fetch(k, k)
    assert trimmable_after([plain], 3) == 9
    assert trimmable_after([rotating], 3) == 9  # it does not wrap yet
    assert trimmable_after([rotating], 4) == 0  # it would
    assert trimmable_after([plain, state], 3) == 0  # a recurrent state cannot go back


# -- the engine on the real model ---------------------------------------------------------


def _ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def _answer(scheduler: Scheduler, ids, settings) -> tuple[list[int], Finished]:
    handle = scheduler.submit(Request(ids, settings))
    tokens, done = [], None
    for ev in handle.events():
        if isinstance(ev, TokenDelta) and ev.token >= 0:
            tokens.append(ev.token)
        if isinstance(ev, Finished):
            done = ev
    return tokens, done


@pytest.mark.model
def test_a_drafted_greedy_answer_is_mlx_lms_greedy_answer(default_model):
    ids = _ids(default_model, COPY)
    ref = greedy_tokens(default_model, ids, 40, [])
    scheduler = Scheduler(default_model, draft_tokens=8)
    tokens, done = _answer(scheduler, ids, GenerationSettings(max_tokens=40))
    assert tokens == ref[: len(tokens)] and len(tokens) == 40
    assert scheduler.accepted >= 20 and scheduler.drafted <= 40 * 8
    assert done.stats.kv_tokens_seen == len(ids) + 40  # the caches hold what was taken
    assert scheduler.status()["draft_tokens_accepted"] == scheduler.accepted


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [10, 13])
def test_an_answer_cut_by_its_length_leaves_exact_caches(default_model, max_tokens):
    """Wherever ``max_tokens`` falls among the drafted steps, the answer is the plain one
    and its caches end with its last token: the prefix cache keeps them, and the next
    turn reuses the whole conversation."""
    ids = _ids(default_model, COPY)
    plain = Scheduler(default_model, draft_tokens=0)
    ref, ref_done = _answer(plain, ids, GenerationSettings(max_tokens=max_tokens))
    prefix = PrefixCache(1 << 30)
    scheduler = Scheduler(default_model, draft_tokens=8, prefix_cache=prefix)
    tokens, done = _answer(scheduler, ids, GenerationSettings(max_tokens=max_tokens))
    assert tokens == ref
    assert scheduler.accepted > 0
    assert done.stats.kv_tokens_seen == ref_done.stats.kv_tokens_seen == len(ids) + max_tokens
    again = ids + tokens + _ids(default_model, "Thanks.")[1:]
    _, next_done = _answer(scheduler, again, GenerationSettings(max_tokens=2))
    assert next_done.stats.prompt_tokens_cached == len(ids) + max_tokens


@pytest.mark.model
@pytest.mark.parametrize(
    "stop",
    [
        pytest.param("truth", marks=pytest.mark.slow),
        "single man",
        pytest.param("good fortune", marks=pytest.mark.slow),
        pytest.param(None, marks=pytest.mark.slow),  # EOS: the longest of them
    ],
)
def test_an_end_inside_the_drafts_ends_the_answer_and_its_caches_there(default_model, stop):
    """A stop string, or EOS (the chat template's end of turn follows the passage in the
    prompt, so it comes as a draft with the template's next tokens after it): the answer
    and its caches end there, and the prefix cache keeps the whole conversation."""
    ids = _ids(default_model, COPY)
    settings = GenerationSettings(max_tokens=120, stop=(stop,) if stop else ())
    ref, ref_done = _answer(Scheduler(default_model), ids, settings)
    scheduler = Scheduler(default_model, draft_tokens=8, prefix_cache=PrefixCache(1 << 30))
    tokens, done = _answer(scheduler, ids, settings)
    assert (done.text, tokens) == (ref_done.text, ref)
    assert done.finish_reason == ref_done.finish_reason == ("stop_string" if stop else "stop")
    n = len(ids) + done.stats.generation_tokens
    assert done.stats.kv_tokens_seen == ref_done.stats.kv_tokens_seen == n
    again = ids + tokens + _ids(default_model, "Thanks.")[1:]
    _, next_done = _answer(scheduler, again, GenerationSettings(max_tokens=2))
    assert next_done.stats.prompt_tokens_cached >= len(ids) + len(tokens)


@pytest.mark.model
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(KVPolicy(window=96, sinks=4), id="sink 4 + window 96", marks=pytest.mark.slow),
        pytest.param(
            KVPolicy(window=96, sinks=4, bits=8, key_scheme="rotated"),
            id="8-bit rotated keys, window 96",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_window_that_evicts_while_drafting_answers_as_without_drafts(default_model, policy):
    """The window (100 tokens) fills during the answer to a 116-token prompt: drafts
    rejected after it has evicted come back out through the undo log."""
    ids = _ids(default_model, COPY)
    settings = GenerationSettings(max_tokens=60)
    ref, _ = _answer(Scheduler(default_model, policy), ids, settings)
    scheduler = Scheduler(default_model, policy, draft_tokens=8)
    tokens, done = _answer(scheduler, ids, settings)
    assert tokens == ref
    assert done.stats.kv_evicted > 0 and scheduler.accepted >= 20


@pytest.mark.model
def test_a_drafting_window_request_holds_no_more_than_it_reserved(default_model):
    """A window cache keeps an undo log for its drafts beside its KV: while the request
    decodes, what MLX holds beyond what it held before stays within the request's
    reservation, which counts the log at its longest. (Recorded, the evicting prefill
    chunk's input and the slots it overwrote stayed beside the cache, unreserved.)"""
    import gc

    from mlxkv.engine.admission import MemoryBudget

    policy = KVPolicy(window=96, sinks=4)
    ids = _ids(default_model, COPY)  # 116 tokens: the prefill chunk evicts
    settings = GenerationSettings(max_tokens=40)
    _answer(Scheduler(default_model, policy, draft_tokens=8), ids, settings)  # MLX's buffers
    gc.collect()
    before = mx.get_active_memory()
    memory = MemoryBudget(default_model, 1 << 40, 4, 512, draft_tokens=8)  # never refuses
    scheduler = Scheduler(default_model, policy, memory=memory, draft_tokens=8)
    handle = scheduler.submit(Request(ids, settings))
    worst = worst_beyond_counted(scheduler, handle, before, lambda m: m["reserved_bytes"])
    assert scheduler.accepted > 0
    step_logits = 9 * default_model.config["vocab_size"] * 4  # 8 drafts and the token before
    assert worst < step_logits + (1 << 20), worst  # (in the runtime share) and rounding
    # the reservation counts the undo log at its longest (30 layers, 3 KV heads of 64)
    plain = MemoryBudget(default_model, 1 << 40, 4, 512).reservation(policy, 200)
    log = 30 * pb.undo_log_bytes(policy, 8, 3, 64, 64, 4)
    assert memory.reservation(policy, 200) == plain + log > plain


@pytest.mark.model
@pytest.mark.slow
def test_kivi_keys_check_drafts_only_inside_the_group_being_filled(default_model):
    policy = KVPolicy(key_bits=4)
    ids = _ids(default_model, COPY)
    scheduler = Scheduler(default_model, policy, draft_tokens=8)
    assert scheduler.undo_reserve(policy) == 0
    tokens, done = _answer(scheduler, ids, GenerationSettings(max_tokens=60))
    assert scheduler.accepted > 0 and len(tokens) > 20
    assert done.stats.kv_tokens_seen == len(ids) + done.stats.generation_tokens  # EOS too


@pytest.mark.model
@pytest.mark.slow
def test_penalties_and_logit_bias_judge_each_drafted_position_as_a_plain_step(default_model):
    """Stateless logits processors are applied at every drafted position with the tokens
    before it: the drafted answer is the plain one, and a token the bias bans is never
    taken from the passage."""
    ids = _ids(default_model, COPY)
    banned = default_model.tokenizer.encode(" truth", add_special_tokens=False)[0]
    settings = GenerationSettings(
        max_tokens=40, repetition_penalty=1.1, frequency_penalty=0.2, logit_bias=((banned, -100.0),)
    )
    plain, _ = _answer(Scheduler(default_model, draft_tokens=0), ids, settings)
    scheduler = Scheduler(default_model, draft_tokens=8)
    drafted, _ = _answer(scheduler, ids, settings)
    assert drafted == plain and banned not in plain
    assert scheduler.accepted >= 5


@pytest.mark.model
@pytest.mark.slow
def test_an_end_held_back_for_min_tokens_is_let_through_at_a_drafted_position(default_model):
    """``min_tokens`` holds EOS back (a processor that counts the tokens it is shown). Given
    the plain answer and its EOS as the prediction, EOS arrives as a draft several positions
    into a step, and it must be let through exactly where a plain step lets it through:
    each position counts the tokens before it, not the step's first."""
    ids = _ids(default_model, COPY)
    plain, done = _answer(Scheduler(default_model, draft_tokens=0), ids, GenerationSettings())
    assert done.finish_reason == "stop"
    eos = sorted(default_model.tokenizer.eos_token_ids)[0]
    scheduler = Scheduler(default_model, draft_tokens=8)
    # EOS came after len(plain) tokens: holding it back until then changes no argmax
    settings = GenerationSettings(min_tokens=len(plain))
    handle = scheduler.submit(Request(ids, settings, prediction=[*plain, eos]))
    events = list(handle.events())
    drafted = [e.token for e in events if isinstance(e, TokenDelta) and e.token >= 0]
    assert drafted == plain and events[-1].finish_reason == "stop"
    assert scheduler.accepted >= len(plain) // 2


@pytest.mark.model
@pytest.mark.slow
def test_seeded_answers_and_batches_take_no_drafts(default_model):
    ids = _ids(default_model, COPY)
    scheduler = Scheduler(default_model, draft_tokens=8)
    _answer(scheduler, ids, GenerationSettings(max_tokens=20, temperature=0.7, seed=1))
    assert scheduler.drafted == 0  # its text may not depend on whether it decoded alone
    both = [scheduler.submit(Request(ids, GenerationSettings(max_tokens=20))) for _ in range(2)]
    for h in both:
        list(h.events())
    assert scheduler.drafted == 0  # two rows decode as a batch
    assert scheduler.status()["max_rows_in_a_step"] == 2


@pytest.mark.model
@pytest.mark.slow  # (the session's path is in the fast suite through the cache file test)
def test_a_chat_session_with_drafts_keeps_its_turns(default_model):
    """generate and chat: each turn's answer is the plain one, and the next turn reuses the
    whole conversation from the session's caches."""
    settings = GenerationSettings(max_tokens=30)
    policy = KVPolicy(window=96, sinks=4)
    mine = Session(default_model, policy, draft_tokens=8)
    plain = Session(default_model, policy)
    drafted, ref = ChatSession(mine, settings), ChatSession(plain, settings)
    for turn in [COPY, "Now copy it once more."]:
        want = [e for e in ref.send(turn) if isinstance(e, Finished)][0]
        got = [e for e in drafted.send(turn) if isinstance(e, Finished)][0]
        assert got.text == want.text
        assert got.stats.prompt_tokens_cached == want.stats.prompt_tokens_cached > 0 or turn == COPY
        assert mine.tokens == plain.tokens  # the ids its caches hold, in order
        assert got.stats.kv_tokens_seen == want.stats.kv_tokens_seen
    assert mine.scheduler.accepted > 0 and plain.scheduler.drafted == 0


@pytest.mark.model
def test_a_cache_file_reads_whatever_undo_log_its_writer_kept(default_model, tmp_path):
    """A session with drafts saves window caches with an undo log of 8 tokens; one without
    reads them; a crafted log length is refused in one line."""
    policy = KVPolicy(window=64, sinks=4)
    writer = Session(default_model, policy, draft_tokens=8)
    for _ in writer.run(COPY, GenerationSettings(max_tokens=4)):
        pass
    path = tmp_path / "c.safetensors"
    writer.save_cache(path)
    reader = Session(default_model, policy, draft_tokens=0)
    reader.load_cache(path)
    assert reader.tokens == writer.tokens
    assert [c.reserve for c in reader.caches] == [8] * len(reader.caches)

    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays["0.reserve"] = mx.array(10**6)
    crafted = tmp_path / "crafted.safetensors"
    mx.save_safetensors(str(crafted), arrays, meta)
    before = crafted.read_bytes()
    with pytest.raises(CacheError) as e:
        Session(default_model, policy).load_cache(crafted)
    assert "layer 0: reserve is 1000000" in str(e.value) and "\n" not in str(e.value)
    assert crafted.read_bytes() == before


@pytest.mark.model
def test_a_drafted_answer_with_logprobs_gives_each_token_the_plain_steps_logprobs(default_model):
    """Logprobs asked: a draft step gives every token it takes the logprob and best
    alternatives its own position's logits give (a plain step's, to float32 rounding of a
    call over several positions), and the answer is the plain one."""
    ids = _ids(default_model, COPY)
    settings = GenerationSettings(max_tokens=20)

    def answer(drafts: int):
        scheduler = Scheduler(default_model, draft_tokens=drafts)
        handle = scheduler.submit(Request(ids, settings, logprobs=3))
        deltas = [e for e in handle.events() if isinstance(e, TokenDelta) and e.token >= 0]
        return scheduler, deltas

    _, plain = answer(0)
    scheduler, drafted = answer(8)
    assert scheduler.accepted >= 8
    assert [d.token for d in drafted] == [d.token for d in plain] and len(plain) == 20
    for d, p in zip(drafted, plain, strict=True):
        assert d.logprob == pytest.approx(p.logprob, abs=1e-4)
        assert [i for i, _ in d.top_logprobs] == [i for i, _ in p.top_logprobs]
        assert [v for _, v in d.top_logprobs] == pytest.approx(
            [v for _, v in p.top_logprobs], abs=1e-4
        )
        assert d.top_logprobs[0][0] == d.token  # greedy: the best is the token taken
