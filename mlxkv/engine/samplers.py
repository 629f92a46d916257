"""How a request picks its next token from log-probabilities (None: greedy argmax)."""

from __future__ import annotations

from collections.abc import Callable

from mlxkv.engine.request import GenerationSettings


class SeededSampler:
    """mlx-lm's make_sampler chain (top-p, min-p, top-k, temperature) drawing from its own
    key, so a seeded request's text does not depend on what else runs beside it."""

    def __init__(self, s: GenerationSettings):
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        self.key = mx.random.key(s.seed)
        self.temp = s.temperature
        self.filters = []
        if 0 < s.top_p < 1:
            self.filters.append(lambda x: apply_top_p(x, s.top_p))
        if s.min_p:
            self.filters.append(lambda x: apply_min_p(x, s.min_p))
        if s.top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, s.top_k))

    def __call__(self, logprobs):
        import mlx.core as mx

        for f in self.filters:
            logprobs = f(logprobs)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=sub)


def sampler_for(s: GenerationSettings) -> Callable | None:
    from mlx_lm.sample_utils import make_sampler

    if s.temperature == 0:
        return None
    if s.seed is not None:
        return SeededSampler(s)
    return make_sampler(s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)
