"""Many independent prompts through one model, results yielded as each one finishes.

Batched decoding uses mlx-lm's ``BatchGenerator`` (continuous batching: a finished sequence
leaves the batch and a waiting prompt is prefilled into its slot). It needs caches that
merge into a batch: the full-cache policy does (``FullKVCache`` is a ``KVCache`` and merges
into ``BatchKVCache``; a model's own rotating or SSM caches merge too). Window, sink and
quantized caches keep per-sequence ring positions and quantized buffers that have no
batched form, so under those policies the prompts run one by one through the engine's
``Generator`` -- same results, no batching speed-up.

Greedy batched outputs are token-identical to the single-sequence ``Generator``: the same
prompt token ids (same BOS rule), the same EOS set, and attention over left-padded rows
masks the padding. Sampled lines with a ``seed`` draw from their own PRNG key, so their
text does not depend on which other prompts share the batch (it does differ from a
seeded single-sequence run, which draws from MLX's global generator).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mlxkv.engine.session import GenerationSettings, Generator, encode_prompt
from mlxkv.engine.stopping import StopMatcher
from mlxkv.errors import UserError
from mlxkv.models.loader import LoadedModel
from mlxkv.policy import KVPolicy


@dataclass(frozen=True)
class Request:
    key: object  # the caller's handle, returned in the Result
    prompt: str  # the full prompt text (chat template already applied)
    settings: GenerationSettings


@dataclass
class Result:
    key: object
    text: str = ""
    finish_reason: str | None = None  # stop | length | stop_string | context
    prompt_tokens: int = 0
    generation_tokens: int = 0  # an EOS counts, like the Generator's stats
    latency_s: float = 0.0  # prefill start -> finished
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    error: str | None = None  # set instead of text when this prompt could not run


def why_not_batched(loaded: LoadedModel, policy: KVPolicy) -> str | None:
    """None if ``policy`` caches merge into a batch on this model, else the reason."""
    from mlxkv.caches import make_caches

    if policy.window is not None or policy.bits is not None:
        return f"the {policy.describe()} cache has no batched form"
    caches = make_caches(loaded.model, policy)
    kinds = sorted({type(c).__name__ for c in caches if not hasattr(c, "merge")})
    if kinds:
        return f"{', '.join(kinds)} caches cannot be merged into a batch"
    return None


def _too_long(loaded: LoadedModel, policy: KVPolicy, n_prompt: int) -> str | None:
    from mlxkv.memory.context import past_trained_context

    limit = loaded.context_length
    if past_trained_context(limit, policy.window, n_prompt + 1):  # + the first reply token
        return (
            f"the prompt has {n_prompt} tokens but the model's context is {limit}; "
            "shorten it or use a window (--kv-window)"
        )
    return None


class _SeededSampler:
    """make_sampler's chain (top-p, min-p, top-k, temperature) drawing from its own key."""

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


@dataclass
class _Live:
    """A sequence inside the BatchGenerator."""

    request: Request
    n_prompt: int
    max_tokens: int
    capped: bool  # max_tokens was cut to fit the context
    tokens: list
    stop: StopMatcher | None = None
    detok: object = None
    started: float = 0.0
    first_token: float = 0.0


class BatchRunner:
    """Runs requests batched when the policy allows it, else one by one."""

    def __init__(
        self,
        loaded: LoadedModel,
        policy: KVPolicy | None = None,
        batch_size: int = 16,
        prefill_step: int = 512,
        prefill_batch_size: int = 8,
    ):
        if batch_size < 1:
            raise UserError(f"--batch-size must be at least 1, got {batch_size}")
        self.loaded = loaded
        self.policy = policy or KVPolicy()
        self.batch_size = batch_size
        self.prefill_step = prefill_step
        self.prefill_batch_size = max(1, min(prefill_batch_size, batch_size))
        self.fallback_reason = why_not_batched(loaded, self.policy)

    @property
    def batched(self) -> bool:
        return self.fallback_reason is None

    def run(self, requests: Iterable[Request]) -> Iterator[Result]:
        if self.batched:
            yield from self._run_batched(requests)
        else:
            yield from self._run_one_by_one(requests)

    # -- one by one: the engine's Generator, for policies that cannot batch -----------------
    def _run_one_by_one(self, requests: Iterable[Request]) -> Iterator[Result]:
        from mlxkv.engine.events import Finished

        gen = Generator(self.loaded, self.policy, overflow="stop")
        for req in requests:
            gen.reset()  # independent prompts: nothing to reuse
            tic = time.perf_counter()
            try:
                n_prompt = len(encode_prompt(self.loaded.tokenizer, req.prompt))
                err = _too_long(self.loaded, self.policy, n_prompt)
                if err:
                    yield Result(req.key, error=err, prompt_tokens=n_prompt)
                    continue
                final = None
                for ev in gen.run(req.prompt, req.settings):
                    if isinstance(ev, Finished):
                        final = ev
            except UserError as e:
                yield Result(req.key, error=str(e))
                continue
            s = final.stats
            yield Result(
                req.key,
                final.text,
                final.finish_reason,
                s.prompt_tokens,
                s.generation_tokens,
                time.perf_counter() - tic,
                s.prompt_tps,
                s.generation_tps,
            )

    # -- batched: mlx-lm's BatchGenerator ---------------------------------------------------
    def _run_batched(self, requests: Iterable[Request]) -> Iterator[Result]:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        from mlxkv.caches import make_caches

        loaded, tok = self.loaded, self.loaded.tokenizer
        gen = BatchGenerator(
            loaded.model,
            stop_tokens=[[t] for t in tok.eos_token_ids],
            completion_batch_size=self.batch_size,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step,
        )
        shared_samplers: dict = {}  # unseeded lines with equal settings share one sampler

        def sampler_for(s: GenerationSettings):
            if s.temperature == 0:
                return None  # the generator's greedy fallback: one argmax for the batch
            if s.seed is not None:
                return _SeededSampler(s)
            key = (s.temperature, s.top_p, s.min_p, s.top_k)
            if key not in shared_samplers:
                shared_samplers[key] = make_sampler(
                    s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k
                )
            return shared_samplers[key]

        live: dict[int, _Live] = {}
        pending = iter(requests)
        exhausted = False
        # Keep a queue behind the running batch so a freed slot is refilled at once,
        # but read requests lazily (the input may be long).
        target = 2 * self.batch_size
        try:
            while True:
                while not exhausted and len(live) < target:
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                        break
                    ids = encode_prompt(tok, req.prompt)
                    err = _too_long(loaded, self.policy, len(ids))
                    if err:
                        yield Result(req.key, error=err, prompt_tokens=len(ids))
                        continue
                    s = req.settings
                    max_tokens, capped = s.max_tokens, False
                    limit = loaded.context_length
                    if limit and limit - len(ids) < max_tokens:
                        max_tokens, capped = limit - len(ids), True
                    (uid,) = gen.insert(
                        [ids],
                        [max_tokens],
                        caches=[make_caches(loaded.model, self.policy)],
                        samplers=[sampler_for(s)],
                        logits_processors=[
                            make_logits_processors(repetition_penalty=s.repetition_penalty)
                        ],
                    )
                    entry = _Live(req, len(ids), max_tokens, capped, [])
                    if s.stop:
                        entry.stop, entry.detok = StopMatcher(s.stop), tok.detokenizer
                    live[uid] = entry
                if not live:
                    return
                tic = time.perf_counter()
                prompt_responses, responses = gen.next()
                now = time.perf_counter()
                for p in prompt_responses:
                    if not live[p.uid].started:
                        live[p.uid].started = tic
                finished = []
                for r in responses:
                    entry = live[r.uid]
                    if not entry.tokens:
                        entry.first_token = now
                    entry.tokens.append(r.token)
                    reason = r.finish_reason
                    if reason is None and entry.stop is not None:
                        reason = self._check_stop(entry, r.token)
                        if reason is not None:
                            finished.append(r.uid)  # still in the batch: take it out
                    if reason is not None:
                        yield self._result(r.uid, live.pop(r.uid), reason, now)
                if finished:
                    gen.remove(finished)
        finally:
            gen.close()
            mx.clear_cache()

    @staticmethod
    def _check_stop(entry: _Live, token: int) -> str | None:
        entry.detok.add_token(token)
        if entry.stop.find(entry.detok.text) is not None:
            return "stop_string"
        return None

    def _result(self, uid: int, e: _Live, reason: str, now: float) -> Result:
        tok = self.loaded.tokenizer
        eos = set(tok.eos_token_ids)
        ids = e.tokens[:-1] if reason == "stop" and e.tokens[-1] in eos else e.tokens
        text = tok.decode(ids)
        if reason == "stop_string":
            text = text[: e.stop.find(text)]
        elif reason == "length" and e.capped:
            reason = "context"
        started = e.started or now
        first = e.first_token or now
        n = len(e.tokens)
        return Result(
            e.request.key,
            text,
            reason,
            e.n_prompt,
            n,
            now - started,
            e.n_prompt / (first - started) if first > started else 0.0,
            (n - 1) / (now - first) if n > 1 and now > first else 0.0,
        )
