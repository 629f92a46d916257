"""Which drafts a step keeps: the argmax rule of a greedy answer, and speculative sampling
for a sampled one, whose tokens must come from the sampler's own distribution whatever the
drafts were (checked against the exact distribution), and on the real model."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mlxkv.engine.events import TokenDelta
from mlxkv.engine.request import GenerationSettings
from mlxkv.engine.samplers import SamplingWeights, sampling_weights_for
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.engine.speculative import check_greedy, check_sampled
from tests.mlx_lm_ref import greedy_tokens

NEG = -math.inf


def test_greedy_keeps_the_drafts_up_to_the_first_that_is_not_the_argmax():
    logits = mx.array(
        [[0.0, 5.0, 1.0], [0.0, 1.0, 5.0], [5.0, 1.0, 0.0], [0.0, 0.0, 9.0]]
    )  # argmax 1, 2, 0, 2
    assert check_greedy(logits, [1, 2, 0]) == (3, 2)  # all kept: the last position's argmax
    assert check_greedy(logits, [1, 2, 1]) == (2, 0)
    assert check_greedy(logits, [2, 2, 0]) == (0, 1)  # a later match does not count


def test_a_certain_draft_is_always_kept_and_an_impossible_one_never():
    certain = mx.array([[NEG, 0.0, NEG], [0.0, 0.0, 0.0]])  # p(1) = 1, then uniform
    impossible = mx.array([[0.0, NEG, 0.0], [0.0, 0.0, 0.0]])  # p(1) = 0
    for i in range(50):
        taken, _ = check_sampled(certain, [1], key=mx.random.key(i))
        assert taken == 1
        taken, token = check_sampled(impossible, [1], key=mx.random.key(i))
        assert taken == 0 and token in (0, 2)


def _exact(probs: list[list[float]], drafts: list[int]) -> dict[tuple[int, int], float]:
    """The probability of each (drafts kept, next token) when every token is drawn from its
    position's distribution: the answer keeps ``d_0..d_{k-1}`` and then draws ``x``."""
    out, reach = {}, 1.0
    for k, row in enumerate(probs):
        for x, p in enumerate(row):
            if k < len(drafts) and x == drafts[k]:
                continue  # drawing the draft is keeping it
            out[(k, x)] = reach * p
        if k < len(drafts):
            reach *= row[drafts[k]]
    return out


def test_sampled_drafts_give_the_samplers_own_distribution():
    weights = mx.array(
        [
            [0.3, 1.2, NEG, -0.5],  # a filtered token (-inf) and weights that do not sum to 1
            [1.0, 1.0, 0.2, NEG],
            [0.0, 2.0, 0.5, 0.1],
        ]
    )
    drafts = [1, 0]
    probs = mx.softmax(weights, axis=-1).tolist()
    exact = _exact(probs, drafts)
    trials = 4000
    seen: dict[tuple[int, int], int] = {}
    for i in range(trials):
        got = check_sampled(weights, drafts, key=mx.random.key(i))
        seen[got] = seen.get(got, 0) + 1
    assert set(seen) <= {k for k, p in exact.items() if p > 0}  # never a draft drawn twice
    chi2 = sum((seen.get(k, 0) - trials * p) ** 2 / (trials * p) for k, p in exact.items() if p)
    # 8 outcomes (7 degrees of freedom): 24.3 is the 0.1% tail. Drawing the next token from
    # the whole distribution instead of the one less the draft gives 870 here.
    assert chi2 < 24.3, (chi2, seen)


def test_the_weights_are_the_samplers_filters_over_its_temperature():
    logits = mx.array([[2.0, 1.0, 0.0, -1.0]])
    s = GenerationSettings(temperature=0.5, top_k=2)
    got = SamplingWeights(s)(logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    top2 = logprobs[0, :2] / 0.5
    assert got[0, 2:].tolist() == [NEG, NEG]
    assert mx.allclose(got[0, :2], top2).item()
    # greedy and seeded answers are not checked this way
    assert sampling_weights_for(GenerationSettings()) is None
    assert sampling_weights_for(GenerationSettings(temperature=0.7, seed=3)) is None
    assert sampling_weights_for(GenerationSettings(temperature=0.7)) is not None


@pytest.mark.parametrize("chance", [0.5, 1.0])
def test_xtc_weights_are_what_its_sampler_draws_from(chance):
    """XTC draws a coin each step: cut the likeliest tokens (those above the threshold but
    the least likely of them) or not. The weights are the mixture of the two outcomes, and
    mlx-lm's own sampler's draws follow it (with top-k after XTC, as its chain has it)."""
    from mlx_lm.sample_utils import make_sampler

    logits = mx.array([[2.0, 1.6, 1.0, 0.2, -1.0, -3.0]])
    kw = dict(top_k=5, xtc_probability=chance, xtc_threshold=0.1, xtc_special_tokens=[5])
    s = GenerationSettings(temperature=0.8, top_k=5, xtc_probability=chance, xtc_threshold=0.1)
    want = mx.softmax(SamplingWeights(s, [5])(logits), axis=-1)[0].tolist()
    sampler = make_sampler(0.8, **kw)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.random.seed(0)
    trials, seen = 4000, [0] * 6
    for _ in range(trials):
        seen[sampler(logprobs).item()] += 1
    chi2 = sum((n - trials * p) ** 2 / (trials * p) for n, p in zip(seen, want, strict=True) if p)
    assert all(n == 0 for n, p in zip(seen, want, strict=True) if p == 0)
    # at most 6 outcomes (5 degrees of freedom): 20.5 is the 0.1% tail. At chance 0.5
    # either outcome alone (cut, or not) gives 693 and 3485 here.
    assert chi2 < 20.5, (chi2, seen, want)


PASSAGE = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife."
)


def _answer(scheduler, ids, settings) -> list[int]:
    tokens = []
    for ev in scheduler.submit(Request(ids, settings)).events():
        if isinstance(ev, TokenDelta) and ev.token >= 0:
            tokens.append(ev.token)
    return tokens


@pytest.mark.model
@pytest.mark.slow
def test_sampling_from_the_top_token_alone_with_drafts_is_the_greedy_answer(default_model):
    """top_k 1 leaves the sampler one token to draw: speculative sampling must keep
    exactly the drafts greedy decoding keeps and draw exactly its tokens."""
    ids = default_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Copy this passage word for word:\n\n{PASSAGE}"}],
        add_generation_prompt=True,
    )
    ref = greedy_tokens(default_model, ids, 30, [])
    scheduler = Scheduler(default_model, draft_tokens=8)
    settings = GenerationSettings(max_tokens=30, temperature=1.0, top_k=1)
    tokens = _answer(scheduler, ids, settings)
    assert tokens == ref[: len(tokens)]
    assert len(tokens) == 30 or ref[len(tokens)] in default_model.tokenizer.eos_token_ids
    assert scheduler.accepted >= 10


@pytest.mark.model
@pytest.mark.slow
def test_a_sampled_copy_takes_drafts(default_model):
    ids = default_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Copy this passage word for word:\n\n{PASSAGE}"}],
        add_generation_prompt=True,
    )
    mx.random.seed(0)  # (the answer is drawn from MLX's global key)
    scheduler = Scheduler(default_model, draft_tokens=8)
    tokens = _answer(scheduler, ids, GenerationSettings(max_tokens=30, temperature=0.3))
    # (this model at 0.3 rewords the passage on some draws: 6 to 19 taken on seeds 0-3)
    assert len(tokens) >= 10 and scheduler.accepted > 0


@pytest.mark.model
def test_an_xtc_answer_takes_drafts_and_draws_from_its_own_distribution(default_model):
    """XTC at chance 1 with top-k 1 leaves one token to draw each step: the likeliest left
    after the cut (mlx-lm's chain, as a processor of mlx-lm's generate_step, is the
    reference). Given that answer as the prediction, the drafted answer keeps the drafts
    its mixture weights give probability 1 and draws the reference's tokens."""
    from mlx_lm.sample_utils import apply_xtc

    from mlxkv.engine.samplers import xtc_exempt

    tok = default_model.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": f"Copy this passage word for word:\n\n{PASSAGE}"}],
        add_generation_prompt=True,
    )
    exempt = xtc_exempt(tok)

    def cut(_tokens, logits):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return apply_xtc(logprobs, 1.0, 0.1, exempt)

    ref = greedy_tokens(default_model, ids, 16, [cut])
    scheduler = Scheduler(default_model, draft_tokens=8)
    settings = GenerationSettings(
        max_tokens=16, temperature=1.0, top_k=1, xtc_probability=1.0, xtc_threshold=0.1
    )
    handle = scheduler.submit(Request(ids, settings, prediction=ref))
    tokens = [e.token for e in handle.events() if isinstance(e, TokenDelta) and e.token >= 0]
    assert tokens == ref[: len(tokens)]
    assert len(tokens) == 16 or ref[len(tokens)] in tok.eos_token_ids
    assert scheduler.accepted >= 8
