"""Many independent prompts through one model, results yielded as each one finishes.

Two batched loops, both continuous (a finished sequence leaves the batch and a waiting
prompt is prefilled into its slot):

* The full-cache policy runs in mlx-lm's ``BatchGenerator`` (``FullKVCache`` is a
  ``KVCache`` and merges into its ``BatchKVCache``; a model's own rotating or SSM caches
  merge too).
* Window, sink and quantized caches run in the engine's own row loop (``_run_rows``) over
  :class:`mlxkv.caches.batched.BatchedKVCache`. ``BatchGenerator`` cannot host them: it
  prefills new prompts together, left-padded, in chunks whose boundaries the whole prefill
  batch shares, and its caches must follow that padding. A sink cache keeps chunked prefill
  exact only with per-row chunk sizes (``prefill_chunk``) and one set of shifted sink copies
  per query, and a quantized cache has no ``BatchKVCache`` to merge into. So the row loop
  prefills each joining prompt alone, in its single-sequence cache, with exactly the
  ``Generator``'s chunking (exact by construction), then merges that cache into the batch,
  where every row keeps its own positions, evictions and sink shift and decodes one token
  per step. A prefix shared by waiting prompts (a system prompt, a document asked several
  questions) is prefilled once and copied into each row (:class:`SharedPrefixes`).

Greedy batched outputs are token-identical to the single-sequence ``Generator``: the same
prompt token ids (same BOS rule), the same EOS set, and attention over the batch masks
what a row does not hold (left padding in ``BatchGenerator``, unused slots in the row
loop). Sampled lines with a ``seed`` draw from their own PRNG key, so their text does not
depend on which other prompts share the batch (it does differ from a seeded
single-sequence run, which draws from MLX's global generator).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice

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


def why_not_batched(
    loaded: LoadedModel, policy: KVPolicy, row_loop: bool | None = None
) -> str | None:
    """None if ``policy`` caches can be batched on this model, else the reason."""
    from mlxkv.caches import make_caches
    from mlxkv.caches.batched import batched_form

    caches = make_caches(loaded.model, policy)
    if _uses_rows(policy) if row_loop is None else row_loop:
        why = batched_form(caches)
        return None if why is None else f"{why} under the {policy.describe()} cache"
    kinds = sorted({type(c).__name__ for c in caches if not hasattr(c, "merge")})
    if kinds:
        return f"{', '.join(kinds)} caches cannot be merged into a batch"
    return None


def _uses_rows(policy: KVPolicy) -> bool:
    """Window, sink and quantized caches run in the engine's own row loop (see above)."""
    return policy.window is not None or policy.bits is not None


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


@dataclass
class _Row:
    """A sequence in the engine's row loop."""

    live: _Live
    caches: list | None  # its single-sequence caches until it joins the batch
    next_input: int  # the token the next step feeds (the last prompt token at first)
    sampler: Callable | None  # None: greedy
    processors: list
    history: object = None  # tokens the logits processors see (like generate_step's)


class SharedPrefixes:
    """A prompt prefix prefilled once; rows whose prompt starts with it copy its caches.

    When a prompt is admitted, the prefix it shares with every waiting prompt that shares
    at least ``min_tokens`` with it is the candidate; a candidate equal to the stored prefix
    (or the stored prefix itself, when the prompt starts with it) is reused as is.
    """

    def __init__(self, make_caches: Callable[[], list], min_tokens: int = 64):
        self.make_caches = make_caches
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.caches: list | None = None
        self.hits = 0
        self.prefilled_tokens = 0

    @staticmethod
    def _common(a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i

    def lookup(self, ids: list[int], others: list[list[int]], prefill) -> tuple[int, list | None]:
        """(tokens the returned caches hold, caches to copy) for prompt ``ids``; (0, None) if
        nothing is shared. ``prefill(caches, ids, start, end, step)`` fills a new prefix."""
        last = len(ids) - 1  # the last prompt token is fed by the decode step
        held = len(self.ids)
        if self.caches is not None and held <= last and ids[:held] == self.ids:
            self.hits += 1
            return held, self.caches
        shared = [c for o in others if (c := self._common(ids, o)) >= self.min_tokens]
        if not shared:
            return 0, None
        n = min(min(shared), last)
        if n < self.min_tokens:
            return 0, None
        caches = self.make_caches()
        prefill(caches, ids, 0, n)
        self.ids, self.caches = ids[:n], caches
        self.prefilled_tokens += n
        self.hits += 1
        return n, caches


class KVCheck:
    """Batched KV bytes, actual (the caches' nbytes) next to predicted, at every step."""

    def __init__(self, loaded: LoadedModel, policy: KVPolicy):
        from mlxkv.memory import layout_for

        if getattr(loaded, "layout", None) is None:
            loaded.layout = layout_for(loaded.config)
        self.layout, self.policy, self.dtype = loaded.layout, policy, loaded.dtype
        self.steps = self.mismatches = 0
        self.peak_actual = self.peak_predicted = 0
        self.first_mismatch: tuple[int, int] | None = None

    def observe(self, caches: list) -> None:
        from mlxkv.memory.predictor import batch_allocated

        actual = sum(c.nbytes for c in caches)
        predicted = batch_allocated(self.layout, self.policy, caches[0].n, self.dtype)
        self.steps += 1
        if actual != predicted:
            self.mismatches += 1
            self.first_mismatch = self.first_mismatch or (actual, predicted)
        self.peak_actual = max(self.peak_actual, actual)
        self.peak_predicted = max(self.peak_predicted, predicted)

    def summary(self) -> dict:
        return {
            "kv_bytes_actual_peak": self.peak_actual,
            "kv_bytes_predicted_peak": self.peak_predicted,
            "kv_steps_checked": self.steps,
            "kv_steps_mismatched": self.mismatches,
        }


class BatchRunner:
    """Runs requests batched when the policy allows it, else one by one."""

    def __init__(
        self,
        loaded: LoadedModel,
        policy: KVPolicy | None = None,
        batch_size: int = 16,
        prefill_step: int = 512,
        prefill_batch_size: int = 8,
        share_prefix: bool = True,
        row_loop: bool | None = None,  # None: the row loop for window/sink/quantized caches
    ):
        if batch_size < 1:
            raise UserError(f"--batch-size must be at least 1, got {batch_size}")
        self.loaded = loaded
        self.policy = policy or KVPolicy()
        self.batch_size = batch_size
        self.prefill_step = prefill_step
        self.prefill_batch_size = max(1, min(prefill_batch_size, batch_size))
        self.row_loop = _uses_rows(self.policy) if row_loop is None else row_loop
        self.fallback_reason = why_not_batched(loaded, self.policy, self.row_loop)
        self.share_prefix = share_prefix
        self.kv_check: KVCheck | None = None  # set by batched runs of the row loop

        def fresh():
            from mlxkv.caches import make_caches

            return make_caches(loaded.model, self.policy)

        self.prefixes = SharedPrefixes(fresh)
        self._shared_samplers: dict = {}

    def kv_summary(self) -> dict:
        """KV bytes actual vs predicted over the last batched run ({} when not measured)."""
        out = self.kv_check.summary() if self.kv_check else {}
        if self.kv_check and self.share_prefix:
            out["shared_prefix_tokens"] = self.prefixes.prefilled_tokens
            out["shared_prefix_rows"] = self.prefixes.hits
        return out

    @property
    def batched(self) -> bool:
        return self.fallback_reason is None

    def run(self, requests: Iterable[Request]) -> Iterator[Result]:
        if not self.batched:
            yield from self._run_one_by_one(requests)
        elif self.row_loop:
            yield from self._run_rows(requests)
        else:
            # A full cache decodes in mlx-lm's BatchGenerator, unless the first prompts share
            # a prefix worth prefilling once: then the row loop (it shares, BatchGenerator
            # does not).
            requests = iter(requests)
            head = list(islice(requests, 2 * self.batch_size))
            if self.share_prefix and self._shared_head(head):
                yield from self._run_rows(chain(head, requests))
            else:
                yield from self._run_batched(chain(head, requests))

    def _shared_head(self, head: list[Request]) -> bool:
        from mlxkv.caches import make_caches
        from mlxkv.caches.batched import batched_form

        if len(head) < 2 or batched_form(make_caches(self.loaded.model, self.policy)):
            return False
        tok = self.loaded.tokenizer
        ids = [encode_prompt(tok, r.prompt) for r in head]
        common = SharedPrefixes._common
        return any(
            common(a, b) >= self.prefixes.min_tokens
            for i, a in enumerate(ids)
            for b in ids[i + 1 :]
        )

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
        from mlx_lm.sample_utils import make_logits_processors

        from mlxkv.caches import make_caches

        loaded, tok = self.loaded, self.loaded.tokenizer
        gen = BatchGenerator(
            loaded.model,
            stop_tokens=[[t] for t in tok.eos_token_ids],
            completion_batch_size=self.batch_size,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step,
        )
        sampler_for = self._sampler_for
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

    # -- batched: the engine's own row loop (window, sink, quantized caches) ----------------
    def _run_rows(self, requests: Iterable[Request]) -> Iterator[Result]:
        import mlx.core as mx

        from mlxkv.caches.batched import BatchedKVCache, merge_rows

        model, tok = self.loaded.model, self.loaded.tokenizer
        eos = set(tok.eos_token_ids)
        pending = iter(requests)
        queue: deque[tuple[Request, list[int]]] = deque()
        rows: list[_Row] = []
        caches: list[BatchedKVCache] | None = None
        self.kv_check = KVCheck(self.loaded, self.policy)
        exhausted = False
        try:
            while True:
                # Read ahead so a freed slot is refilled at once and shared prefixes are
                # seen, but lazily (the input may be long).
                while not exhausted and len(queue) < 2 * self.batch_size:
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                        break
                    ids = encode_prompt(tok, req.prompt)
                    err = _too_long(self.loaded, self.policy, len(ids))
                    if err:
                        yield Result(req.key, error=err, prompt_tokens=len(ids))
                        continue
                    queue.append((req, ids))
                joined = []
                while queue and len(rows) + len(joined) < self.batch_size:
                    req, ids = queue.popleft()
                    others = [other for _, other in queue]
                    joined.append(self._prefill_row(req, ids, others))
                if joined:
                    rows.extend(joined)
                    new = [r.caches for r in joined]
                    if caches is None:
                        caches = merge_rows(new)
                    else:
                        for i, c in enumerate(caches):
                            c.extend_rows([n[i] for n in new])
                    for r in joined:
                        r.caches = None  # the batch holds them now
                if not rows:
                    if exhausted and not queue:
                        return
                    continue
                tokens = self._step(model, caches, rows)
                self.kv_check.observe(caches)
                now = time.perf_counter()
                keep = []
                for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
                    e = row.live
                    if not e.tokens:
                        e.first_token = now
                    e.tokens.append(token)
                    row.next_input = token
                    reason = None
                    if token in eos:
                        reason = "stop"
                    elif e.stop is not None:
                        reason = self._check_stop(e, token)
                    if reason is None and len(e.tokens) >= e.max_tokens:
                        reason = "length"
                    if reason is None:
                        keep.append(i)
                    else:
                        yield self._result(0, e, reason, now)
                if len(keep) < len(rows):
                    rows = [rows[i] for i in keep]
                    for c in caches:
                        c.filter(keep)
        finally:
            mx.clear_cache()

    def _prefill_row(self, req: Request, ids: list[int], others: list[list[int]]) -> _Row:
        """Prefill all but the last prompt token in the row's own single-sequence caches,
        chunked exactly like the ``Generator``; a prefix shared with waiting prompts is
        prefilled once and copied."""
        from mlx_lm.sample_utils import make_logits_processors

        from mlxkv.caches import make_caches
        from mlxkv.caches.batched import copy_caches

        loaded, s = self.loaded, req.settings
        started = time.perf_counter()
        done, caches = 0, None
        if self.share_prefix:
            done, caches = self.prefixes.lookup(
                ids, others, lambda c, i, a, b: self._prefill_into(c, i, a, b, s.prefill_step)
            )
        if caches is None:
            caches = make_caches(loaded.model, self.policy)
        else:
            caches = copy_caches(caches)
        self._prefill_into(caches, ids, done, len(ids) - 1, s.prefill_step)
        max_tokens, capped = s.max_tokens, False
        limit = loaded.context_length
        if limit and self.policy.window is None and limit - len(ids) < max_tokens:
            max_tokens, capped = max(limit - len(ids), 1), True
        live = _Live(req, len(ids), max_tokens, capped, [], started=started)
        if s.stop:
            live.stop, live.detok = StopMatcher(s.stop), loaded.tokenizer.detokenizer
        processors = make_logits_processors(repetition_penalty=s.repetition_penalty)
        return _Row(live, caches, ids[-1], self._sampler_for(s), processors)

    def _prefill_into(self, caches: list, ids: list[int], done: int, end: int, step: int):
        import mlx.core as mx

        from mlxkv.caches import prefill_chunk

        prompt = mx.array(ids)
        model = self.loaded.model
        while done < end:
            n = min(prefill_chunk(caches, step), end - done)
            model(prompt[None, done : done + n], cache=caches)
            mx.eval([c.state for c in caches])
            done += n

    def _step(self, model, caches, rows: list[_Row]) -> list[int]:
        """One decode step for every row: feed each row's pending token, sample the next."""
        import mlx.core as mx

        inputs = mx.array([[r.next_input] for r in rows])
        logits = model(inputs, cache=caches)[:, -1, :]
        if any(r.processors for r in rows):
            parts = []
            for i, r in enumerate(rows):
                row = logits[i : i + 1]
                if r.processors:
                    r.history = (
                        mx.concatenate([r.history, inputs[i]])
                        if r.history is not None
                        else inputs[i]
                    )
                    for p in r.processors:
                        row = p(r.history, row)
                parts.append(row)
            logits = mx.concatenate(parts, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.argmax(logprobs, axis=-1)
        sampled = [(i, r.sampler(logprobs[i : i + 1])) for i, r in enumerate(rows) if r.sampler]
        if sampled:
            idx = mx.array([i for i, _ in sampled])
            picked[idx] = mx.concatenate([t.reshape(-1) for _, t in sampled])
        return picked.tolist()

    def _sampler_for(self, s: GenerationSettings):
        from mlx_lm.sample_utils import make_sampler

        if s.temperature == 0:
            return None  # greedy: one argmax for the batch
        if s.seed is not None:
            return _SeededSampler(s)
        key = (s.temperature, s.top_p, s.min_p, s.top_k)  # unseeded lines share one sampler
        if key not in self._shared_samplers:
            self._shared_samplers[key] = make_sampler(
                s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k
            )
        return self._shared_samplers[key]

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
