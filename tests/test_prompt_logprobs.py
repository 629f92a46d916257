"""Prompt scoring on the default model (``Request.prompt_logprobs``): every prompt token's
log-probability given those before it, as one forward pass of mlx-lm's model over the
whole prompt gives it, whatever the prefill chunks; the answer after it unchanged."""

from __future__ import annotations

import pytest

from mlxkv.engine.events import PromptLogprobs, TokenDelta
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.engine.session import GenerationSettings
from mlxkv.policy import KVPolicy

pytestmark = pytest.mark.model

TEXT = "The capital of France is Paris. The capital of Italy is Rome."


def reference(loaded, ids: list[int], k: int):
    """(logprob of each token after the first, its k best) from one mlx-lm forward pass."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    out = loaded.model(mx.array(ids)[None], cache=make_prompt_cache(loaded.model))[0]
    lps = out.astype(mx.float32)
    lps = lps - mx.logsumexp(lps, axis=-1, keepdims=True)
    chosen = [lps[i, t].item() for i, t in enumerate(ids[1:])]
    best = mx.argsort(-lps[:-1], axis=-1)[:, :k].tolist()
    return chosen, best


@pytest.mark.parametrize("step", [512, 5])  # one chunk, and chunks of 5 tokens
def test_prompt_tokens_are_scored_as_one_forward_pass(default_model, step):
    ids = Scheduler(default_model).encode(TEXT)
    chosen, best = reference(default_model, ids, 2)
    settings = GenerationSettings(max_tokens=4, prefill_step=step)
    sched = Scheduler(default_model, KVPolicy(), max_batch=2)
    plain = sched.submit(Request(ids, settings))
    scored = sched.submit(Request(ids, settings, prompt_logprobs=2))
    while sched.step():
        pass
    events = list(scored.events())
    (p,) = [e for e in events if isinstance(e, PromptLogprobs)]
    assert p.tokens == tuple(ids) and len(p.logprobs) == len(ids) - 1
    assert p.logprobs == pytest.approx(chosen, abs=2e-4)  # float32 sums in other orders
    assert [[t for t, _ in top] for top in p.top] == best
    assert all(top[0][1] >= top[1][1] for top in p.top)
    # it comes before the answer, which is the answer of the same prompt unscored
    assert events.index(p) < min(i for i, e in enumerate(events) if isinstance(e, TokenDelta))
    text = [e.text for e in events if isinstance(e, TokenDelta)]
    assert text == [e.text for e in plain.events() if isinstance(e, TokenDelta)]
    # scored, the prompt took nothing from a cache: every token was prefilled
    assert events[-1].stats.prompt_tokens_cached == 0


def test_admission_counts_a_scored_prompts_logits(default_model):
    """A budget that holds the prompt's KV but not its scoring (one chunk's logits at every
    position, beside the KV): the plain request runs, the scored one is refused at once,
    its message giving both figures."""
    from mlxkv.engine.admission import SCORE_BYTES, MemoryBudget
    from mlxkv.engine.events import Failed, Finished

    ids = Scheduler(default_model).encode(TEXT)
    step = 8
    probe = MemoryBudget(default_model, None, 4, step)
    vocab = default_model.layout.facts.vocab_size
    kv = probe.reservation(KVPolicy(), len(ids) + 2)
    assert probe.scoring(len(ids), step) == step * vocab * SCORE_BYTES
    budget = probe.base() + kv + probe.scoring(len(ids), step) // 2
    sched = Scheduler(
        default_model, KVPolicy(), max_batch=4, memory=MemoryBudget(default_model, budget, 4, step)
    )
    settings = GenerationSettings(max_tokens=2, prefill_step=step)
    plain = sched.submit(Request(ids, settings))
    scored = sched.submit(Request(ids, settings, prompt_logprobs=1))
    while sched.step():
        pass
    assert isinstance(list(plain.events())[-1], Finished)
    (refused,) = list(scored.events())
    assert isinstance(refused, Failed) and refused.code == "kv_budget"
    assert "of logits to score its prompt" in refused.message
    assert refused.message.endswith("; raise --memory or serve with a smaller --prefill-step")
