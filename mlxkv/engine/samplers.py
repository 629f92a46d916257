"""How a request picks its next token: the logits processors that reshape its logits, then
the sampler that draws from the log-probabilities (None: greedy argmax)."""

from __future__ import annotations

import math
from collections.abc import Callable

from mlxkv.engine.request import GenerationSettings


def _filters(s: GenerationSettings, xtc: Callable | None = None) -> list[Callable]:
    """mlx-lm's make_sampler chain of filters over log-probabilities: top-p, min-p, XTC
    (``xtc``, when the request asks for it), top-k."""
    before, after = _around_xtc(s)
    return before + ([xtc] if xtc is not None else []) + after


def _around_xtc(s: GenerationSettings) -> tuple[list[Callable], list[Callable]]:
    """The chain's filters before XTC (top-p, min-p) and after it (top-k)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    before = []
    if 0 < s.top_p < 1:
        before.append(lambda x: apply_top_p(x, s.top_p))
    if s.min_p:
        before.append(lambda x: apply_min_p(x, s.min_p))
    after = [lambda x: apply_top_k(x, s.top_k)] if s.top_k > 0 else []
    return before, after


class SeededSampler:
    """mlx-lm's make_sampler chain (top-p, min-p, XTC, top-k, temperature) drawing from its
    own key, so a seeded request's text does not depend on what else runs beside it."""

    def __init__(self, s: GenerationSettings, xtc_exempt: list[int]):
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_xtc

        self.key = mx.random.key(s.seed)
        self.temp = s.temperature
        xtc = None
        if s.xtc_probability > 0:
            # apply_xtc draws its coin from MLX's global key: drawn here from this one,
            # it is applied whenever the coin says so (probability 1 inside)
            def xtc(x):
                self.key, sub = mx.random.split(self.key)
                cut = apply_xtc(x, 1.0, s.xtc_threshold, xtc_exempt)
                return mx.where(mx.random.uniform(key=sub) < s.xtc_probability, cut, x)

        self.filters = _filters(s, xtc)

    def __call__(self, logprobs):
        import mlx.core as mx

        for f in self.filters:
            logprobs = f(logprobs)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=sub)


class SamplingWeights:
    """The log-weights a sampled answer draws each token from: its logits as log-
    probabilities, through the same filters as its sampler, over its temperature. Drafts
    are checked against them (:mod:`mlxkv.engine.speculative`). With XTC, whose coin a
    step draws once (cut the likeliest tokens or not), the weights are the mixture of the
    two outcomes, each with its probability: the distribution the step draws from."""

    def __init__(self, s: GenerationSettings, xtc_exempt: list[int] = ()):
        self.temp = s.temperature
        self.before, self.after = _around_xtc(s)
        self.xtc = s.xtc_probability
        self.threshold, self.exempt = s.xtc_threshold, list(xtc_exempt)

    def __call__(self, logits):
        import mlx.core as mx

        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for f in self.before:
            logprobs = f(logprobs)
        if not self.xtc:
            return self._finish(logprobs)
        from mlx_lm.sample_utils import apply_xtc

        cut = self._finish(apply_xtc(logprobs, 1.0, self.threshold, self.exempt))  # always
        if self.xtc >= 1:
            return cut
        kept = self._finish(logprobs)
        norm = [x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (cut, kept)]
        return mx.logaddexp(norm[0] + math.log(self.xtc), norm[1] + math.log(1 - self.xtc))

    def _finish(self, logprobs):
        for f in self.after:
            logprobs = f(logprobs)
        return logprobs * (1.0 / self.temp)


def sampling_weights_for(s: GenerationSettings, tokenizer=None) -> SamplingWeights | None:
    """What drafts of a sampled answer are checked against; None where they are not: a
    greedy answer (its argmax decides) or a seeded one (its text must not depend on
    whether it decoded alone, the only time drafts are checked). ``tokenizer``: the
    model's, for the tokens XTC never drops."""
    if s.temperature == 0 or s.seed is not None:
        return None
    exempt = xtc_exempt(tokenizer) if s.xtc_probability > 0 else []
    return SamplingWeights(s, exempt)


def xtc_exempt(tokenizer) -> list[int]:
    """The tokens XTC never drops, as mlx_lm.server sets them: the newline and EOS."""
    return tokenizer.encode("\n", add_special_tokens=False) + sorted(tokenizer.eos_token_ids)


def sampler_for(s: GenerationSettings, tokenizer) -> Callable | None:
    from mlx_lm.sample_utils import make_sampler

    if s.temperature == 0:
        return None
    exempt = xtc_exempt(tokenizer) if s.xtc_probability > 0 else []
    if s.seed is not None:
        return SeededSampler(s, exempt)
    return make_sampler(
        s.temperature,
        top_p=s.top_p,
        min_p=s.min_p,
        top_k=s.top_k,
        xtc_probability=s.xtc_probability,
        xtc_threshold=s.xtc_threshold,
        xtc_special_tokens=exempt,
    )


class EndHeld:
    """Keeps EOS from being drawn while the answer has fewer than ``until`` tokens (None:
    for good). ``lead``: the prompt tokens the processors see before the answer's."""

    def __init__(self, eos: list[int], until: int | None, lead: int):
        self.eos, self.until, self.lead = eos, until, lead
        self.mask = None

    def __call__(self, tokens, logits):
        import mlx.core as mx

        if self.until is not None and len(tokens) - self.lead >= self.until:
            return logits
        if self.mask is None or self.mask.shape[-1] != logits.shape[-1]:
            self.mask = mx.zeros((logits.shape[-1],), dtype=logits.dtype)
            self.mask[mx.array(self.eos)] = -mx.inf
        return logits + self.mask


# The prompt tokens the logits processors see before the answer's: mlx-lm's generate_step
# shows them the whole prompt, and its repetition penalty looks at the last 20 tokens
# (``repetition_context``, which a request may widen).
PROMPT_TAIL = 20


def _tail(s: GenerationSettings) -> int:
    return max(PROMPT_TAIL, s.repetition_context)


def processor_history(ids: list[int], s: GenerationSettings):
    """What the processors see at the first answer token: the prompt's last tokens."""
    import mlx.core as mx

    return mx.array(ids[-_tail(s) :])


def processors_for(s: GenerationSettings, prompt: list[int], tokenizer=None) -> list[Callable]:
    """mlx-lm's logits processors for ``s``, each called with the tokens seen so far
    (``processor_history``, then every answer token) and the logits. The repetition
    penalty looks at the last 20 of them, as in mlx-lm; the presence and frequency
    penalties at the whole answer and nothing of the prompt, as OpenAI defines them
    (mlx_lm.server counts the last 20 tokens, the prompt's among them). A thinking budget
    closes a thinking model's think block at ``s.think_budget`` tokens. EOS is held back
    for ``s.min_tokens`` answer tokens (or all, ``s.ignore_eos``), unless a grammar holds
    the answer (it ends where its schema does). A grammar
    (``s.grammar``, read with ``tokenizer``; or ``s.call_grammar``, held over each tool
    call) comes last: what it allows is what is left."""
    from mlx_lm.sample_utils import (
        make_frequency_penalty,
        make_logits_processors,
        make_presence_penalty,
    )

    processors = make_logits_processors(
        logit_bias=dict(s.logit_bias) or None,
        repetition_penalty=s.repetition_penalty,
        repetition_context_size=s.repetition_context,
    )
    lead = min(_tail(s), len(prompt))
    for make, penalty in (
        (make_presence_penalty, s.presence_penalty),
        (make_frequency_penalty, s.frequency_penalty),
    ):
        if penalty:
            over_answer = make(penalty, s.max_tokens)
            processors.append(lambda tokens, logits, p=over_answer: p(tokens[lead:], logits))
    if (s.ignore_eos or s.min_tokens) and s.grammar is None:  # a schema decides its end
        eos = sorted(tokenizer.eos_token_ids)
        processors.append(EndHeld(eos, None if s.ignore_eos else s.min_tokens, lead))
    if s.think_budget is not None:
        from mlxkv.engine.thinking import think_budget

        closer = think_budget(tokenizer, s.think_budget, prompt)
        processors += [closer] if closer is not None else []
    if s.grammar is not None:
        from mlxkv.engine.grammar import GrammarProcessor

        processors.append(GrammarProcessor(s.grammar, tokenizer))
    elif s.call_grammar is not None and getattr(tokenizer, "tool_call_start_tokens", None):
        from mlxkv.engine.grammar import TriggeredGrammar

        trigger = list(tokenizer.tool_call_start_tokens)
        processors.append(TriggeredGrammar(trigger, s.call_grammar, tokenizer))
    return processors
