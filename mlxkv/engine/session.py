"""A generation session: one model, one cache policy, and the token ids its caches hold.

The session owns ``tokens``: exactly the ids the caches have seen, in order. A new turn
brings the token ids of its whole prompt; the session keeps the longest common prefix of
what the caches hold and what the prompt needs (all but the prompt's last token, whose
logits start the answer), removes the rest, and prefills only what follows.

Removing the rest must leave the caches as an uncached run over the kept prefix would have
left them. A full cache trims exactly. A window or sink cache that has evicted cannot bring
back what it dropped, and recurrent states cannot be rewound; for those the session keeps a
copy of the caches at the last turn boundary (the prompt prefilled, before its last token)
and restores it. We chose the copy over a reserve of slots beyond the window because it is
exact for every cache the model builds (SSM states included), costs nothing in the steady
state (one cache's worth of memory, shared until the live cache writes), and makes the
common case exact: a regenerate reuses the whole prompt, the next turn reuses the whole
conversation. Only what neither reaches (a change inside an earlier answer) is rebuilt.

Failure recovery lives here: a turn that breaks off while the model runs (an exception, or
a caller that walks away mid-call) may leave layers out of step, so the caches are
rebuilt; one that stops between model calls keeps them, and ``tokens`` stays exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from mlxkv.engine.events import Event, Finished, Notice, PrefillProgress, Stats, TokenDelta
from mlxkv.engine.kv_stats import KVAccounting
from mlxkv.engine.stopping import StopMatcher
from mlxkv.errors import UserError
from mlxkv.models.loader import LoadedModel
from mlxkv.policy import KVPolicy

OVERFLOW_CHOICES = ("stop", "slide")


@dataclass
class GenerationSettings:
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    prefill_step: int = 512

    def __post_init__(self):
        if self.max_tokens < 1:
            raise UserError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise UserError(f"--temp must be 0 or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.prefill_step < 1:
            raise UserError(f"--prefill-step must be at least 1, got {self.prefill_step}")


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a whole prompt: the tokenizer's BOS is added unless the text (a chat
    template's output, say) already starts with it. Single and batched runs share this."""
    bos = getattr(tokenizer, "bos_token", None)
    add = bool(bos) and not text.startswith(bos)
    return tokenizer.encode(text, add_special_tokens=add)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Checkpoint:
    tokens: list[int]  # what the caches held when the copy was taken
    states: list


@dataclass
class Generator:
    """Runs prompts through one model and cache; ``cancel()`` is safe from any thread."""

    loaded: LoadedModel
    policy: KVPolicy = field(default_factory=KVPolicy)
    overflow: str = "stop"  # at the context limit: stop, or slide into a sink window

    def __post_init__(self):
        if self.overflow not in OVERFLOW_CHOICES:
            raise UserError(f"--on-overflow must be one of {', '.join(OVERFLOW_CHOICES)}")
        from mlxkv.caches import check_policy

        check_policy(self.loaded.model, self.policy)
        self._cancel = threading.Event()
        self.reset()

    # -- cache bookkeeping -------------------------------------------------------------
    def reset(self) -> None:
        """Drop the cache (and everything it held)."""
        from mlxkv.caches import make_caches

        self._install(make_caches(self.loaded.model, self.policy), [])

    def _install(self, caches: list, tokens: list[int]) -> None:
        from mlxkv.caches import always_exact

        self.caches = caches
        self.tokens: list[int] = list(tokens)  # the ids the caches hold, in order
        self._checkpoint: _Checkpoint | None = None
        self._needs_checkpoint = not all(always_exact(c) for c in caches)
        self.kv = KVAccounting(self.loaded, self.policy, self.caches)

    def set_policy(self, policy: KVPolicy) -> None:
        from mlxkv.caches import check_policy

        check_policy(self.loaded.model, policy)
        self.policy = policy
        self.reset()

    @property
    def cached_tokens(self) -> int:
        return len(self.tokens)

    def cancel(self) -> None:
        """Stop the current turn, or the next one if none is running yet."""
        self._cancel.set()

    def stats(self) -> Stats:
        """A snapshot of the cache between turns."""
        return self._stats(0, 0, 0, 0.0, 0.0)

    # -- prompt caches on disk ----------------------------------------------------------
    def identity(self) -> dict:
        """What a saved cache must match to be used here: the model by its content (config,
        weights, tokenizer; never its name), the policy and the dtype."""
        from mlxkv.models.identity import model_identity

        return {
            "model_id": model_identity(self.loaded.path),
            "policy": self.policy.to_dict(),
            "dtype": self.loaded.dtype,
        }

    def save_cache(self, path) -> None:
        """Write the caches, their token ids and the turn-boundary copy to ``path``
        (atomically), so that a later session can go back as far as this one could."""
        import copy

        from mlxkv.caches import save_caches

        caches = list(self.caches)
        meta = dict(self.identity(), model=self.loaded.name, tokens=self.tokens)
        meta["layers"] = len(caches)
        cp = self._checkpoint
        if cp is not None:
            for c, state in zip(self.caches, cp.states, strict=True):
                c = copy.copy(c)
                c.state = state
                caches.append(c)
            meta["checkpoint_tokens"] = cp.tokens
        save_caches(path, caches, meta)

    def load_cache(self, path) -> None:
        """Take the caches and token ids saved at ``path``, every part checked against this
        model and policy first; :class:`CacheError` (one line) otherwise (this session is
        then unchanged)."""
        from mlxkv.caches.persist import load_session

        caches, tokens, cp = load_session(path, self.identity(), self.loaded.model, self.policy)
        self._install(caches, tokens)
        if cp is not None:
            self._checkpoint = _Checkpoint(list(cp[1]), [c.state for c in cp[0]])

    # -- reuse -------------------------------------------------------------------------
    def _reuse(self, ids: list[int]) -> int:
        """Make the caches hold the longest usable prefix of ``ids``; returns its length."""
        from mlxkv.caches import restore, trim_caches, trimmable

        want = common_prefix(self.tokens, ids[:-1])  # the last prompt token is always fed
        drop = len(self.tokens) - want
        if drop == 0:
            return want
        if all(trimmable(c) >= drop for c in self.caches):
            trim_caches(self.caches, drop)
            del self.tokens[want:]
            return want
        cp = self._checkpoint
        if cp is not None and len(cp.tokens) <= want and ids[: len(cp.tokens)] == cp.tokens:
            restore(self.caches, cp.states)
            self.tokens = list(cp.tokens)
            return self._reuse(ids)  # and trim the rest exactly, if the copy holds more
        self.reset()
        return 0

    def _take_checkpoint(self) -> None:
        from mlxkv.caches import snapshot

        if self._needs_checkpoint:
            self._checkpoint = _Checkpoint(list(self.tokens), snapshot(self.caches))

    # -- generation --------------------------------------------------------------------
    def run(self, prompt_text: str, settings: GenerationSettings) -> Iterator[Event]:
        """Generate a continuation of ``prompt_text`` (the whole conversation so far)."""
        if not prompt_text:
            raise UserError("the prompt is empty; type something to send")
        return self.run_tokens(encode_prompt(self.loaded.tokenizer, prompt_text), settings)

    def run_tokens(self, ids: list[int], settings: GenerationSettings) -> Iterator[Event]:
        """Generate a continuation of the prompt ``ids`` (the whole conversation so far).

        Yields PrefillProgress, TokenDelta and Notice events, then one Finished.
        """
        if not ids:
            raise UserError("the prompt is empty; type something to send")
        self._in_model = False
        try:
            yield from self._run(list(ids), settings)
        except BaseException:
            self._recover()
            raise
        finally:
            self._in_model = False
            self._cancel.clear()  # a cancel covers one turn

    def _recover(self) -> None:
        """After a turn broke off: keep the caches when they hold exactly ``tokens``."""
        held = {c.tokens_seen for c in self.caches if hasattr(c, "tokens_seen")}
        if self._in_model or held - {len(self.tokens)}:
            self.reset()

    def _run(self, ids: list[int], settings: GenerationSettings) -> Iterator[Event]:
        yield from self._overflow_check(ids)
        cached = self._reuse(ids)
        yield from self._generate(ids, cached, settings)

    def _overflow_check(self, ids: list[int]) -> Iterator[Event]:
        from mlxkv.memory.context import past_trained_context

        limit = self.loaded.context_length
        needed = len(ids)
        if not past_trained_context(limit, self.policy.window, needed + 1):  # + 1 reply token
            return
        if self.overflow == "stop":
            raise UserError(
                f"the prompt needs {needed} tokens but the model's context is {limit}; "
                "shorten it (or clear the chat), use a window (--kv-window) or "
                "--on-overflow slide"
            )
        self.set_policy(replace(self.policy, window=max(limit // 2, 64), sinks=4))
        yield Notice(
            f"context limit {limit} reached: switched to {self.policy.describe()}; "
            "the conversation is prefilled again"
        )

    def _model_call(self, tokens, logits: bool = False):
        """Feed ``tokens`` to the caches; with ``logits``, return the last position's logits
        (evaluated together with the caches)."""
        import mlx.core as mx

        from mlxkv.models.head import last_logits

        self._in_model = True
        if logits:
            out = last_logits(self.loaded.model, tokens[None], self.caches)[:, -1, :]
            mx.eval(out, [c.state for c in self.caches])
        else:
            out = None
            self.loaded.model(tokens[None], cache=self.caches)
            mx.eval([c.state for c in self.caches])
        self._in_model = False
        return out

    def _generate(self, ids: list[int], cached: int, s: GenerationSettings):
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        from mlxkv.caches import prefill_chunk

        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        if s.seed is not None:
            mx.random.seed(s.seed)
        sampler = make_sampler(s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)
        processors = make_logits_processors(repetition_penalty=s.repetition_penalty)
        max_tokens, capped = s.max_tokens, False
        limit = self.loaded.context_length
        if limit and self.policy.window is None:
            room = limit - len(ids)
            if room < max_tokens:
                max_tokens, capped = max(room, 1), True
        total = len(ids)

        # Chunked prefill (with progress and cancel). The last chunk ends with the prompt's
        # last token and gives the logits of the first answer token, for that position
        # only: the prompt costs no extra one-token model call. Caches that keep a copy
        # at the turn boundary (the prompt without its last token) take that copy first and
        # the last token alone.
        tic = time.perf_counter()
        prompt = mx.array(ids)
        done = cached
        boundary = total - 1 if self._needs_checkpoint else total
        if done == total - 1:
            self._take_checkpoint()
        last = False
        while not last:
            if done >= boundary:  # only the prompt's last token is left
                n = total - done
            else:
                n = min(prefill_chunk(self.caches, s.prefill_step), boundary - done)
            last = done + n == total
            logits = self._model_call(prompt[done : done + n], logits=last)
            self.tokens.extend(ids[done : done + n])
            done += n
            if done == total - 1:
                self._take_checkpoint()
            yield PrefillProgress(
                done - cached, total - cached, self._stats(total, cached, 0, 0.0, 0.0)
            )
            if self._cancel.is_set():
                stats = self._stats(total, cached, 0, 0.0, 0.0, "cancelled")
                yield Finished("", "cancelled", stats)
                return

        # The first token: mlx-lm's generate_step sampling (processors see the prompt's
        # last token, as when generate_step fed it), then generate_step decodes from it.
        history = prompt[-1:]
        for p in processors:
            logits = p(history, logits)
        y = sampler(logits - mx.logsumexp(logits, keepdims=True))
        history_fn = [_with_history(p, history) for p in processors]

        detok = tokenizer.detokenizer
        detok.reset()
        stop = StopMatcher(s.stop)
        eos = set(tokenizer.eos_token_ids)
        gen_ids: list[int] = []
        shown, text, reason = 0, "", None
        prompt_tps = gen_tps = 0.0
        steps = None  # generate_step, started after the first token
        pending = None  # a yielded token the caches have not been fed yet
        while True:
            if steps is None:
                token = y.item()
                pending = token
            else:
                self._in_model = True
                token = next(steps, None)
                self._in_model = False
                if pending is not None:  # generate_step's first step fed it
                    self.tokens.append(pending)
                    pending = None
                if token is None:
                    break
                token = token[0]
                # generate_step feeds each token to the cache before yielding it.
                self.tokens.append(token)
            gen_ids.append(token)
            now = time.perf_counter()
            if len(gen_ids) == 1:
                prompt_tps, tic = (total - cached) / (now - tic), now
            else:
                gen_tps = (len(gen_ids) - 1) / (now - tic)
            if token in eos:
                reason = "stop"
                break
            detok.add_token(token)
            text = detok.text
            cut = stop.find(text)
            if cut is not None:
                text, reason = text[:cut], "stop_string"
                break
            safe = stop.safe_length(text)
            delta, shown = text[shown:safe], max(shown, safe)
            stats = self._stats(total, cached, len(gen_ids), prompt_tps, gen_tps)
            yield TokenDelta(delta, token, stats)
            if self._cancel.is_set():
                reason = "cancelled"
                break
            if len(gen_ids) >= max_tokens:
                break
            if steps is None:
                steps = generate_step(
                    y,
                    model,
                    max_tokens=max_tokens - 1,
                    sampler=sampler,
                    logits_processors=history_fn,
                    prompt_cache=self.caches,
                )
        if pending is not None:  # the caches hold every generated token, as below
            self._model_call(mx.array([pending]))
            self.tokens.append(pending)
        if reason is None:
            reason = "context" if capped else "length"
        if reason != "stop_string":
            detok.finalize()
            text = detok.text
        # The cache holds every generated token, stop strings and EOS included.
        stats = self._stats(total, cached, len(gen_ids), prompt_tps, gen_tps, reason)
        if shown < len(text):
            yield TokenDelta(text[shown:], -1, stats)
        yield Finished(text, reason, stats)

    def _stats(self, prompt_tokens, cached, n_gen, prompt_tps, gen_tps, reason=None) -> Stats:
        return self.kv.snapshot(
            Stats(
                prompt_tokens=prompt_tokens,
                prompt_tokens_cached=cached,
                generation_tokens=n_gen,
                prompt_tps=prompt_tps,
                generation_tps=gen_tps,
                context_limit=self.loaded.context_length,
                policy=self.policy.describe(),
                finish_reason=reason,
            )
        )


def _with_history(processor, history):
    """``processor`` seeing ``history`` before the tokens generate_step passes it."""
    import mlx.core as mx

    return lambda tokens, logits: processor(mx.concatenate([history, tokens]), logits)
