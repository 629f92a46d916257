"""A generation session: one model, one cache policy, a cache that lives across turns.

The cache is described as a list of text chunks (prompt pieces and answers) with their
token counts. A new turn's full prompt text either extends that text (only the new
tokens are prefilled) or diverges from it (the cache is rebuilt from the whole prompt).
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


@dataclass
class _Chunk:
    text: str
    tokens: int


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

        self.caches = make_caches(self.loaded.model, self.policy)
        self.chunks: list[_Chunk] = []
        self.kv = KVAccounting(self.loaded, self.policy, self.caches)

    def set_policy(self, policy: KVPolicy) -> None:
        from mlxkv.caches import check_policy

        check_policy(self.loaded.model, policy)
        self.policy = policy
        self.reset()

    @property
    def cached_text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def cached_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    def _encode(self, text: str, first: bool) -> list[int]:
        tok = self.loaded.tokenizer
        return encode_prompt(tok, text) if first else tok.encode(text, add_special_tokens=False)

    def _keep_if_prefix_of(self, target: str) -> None:
        """Keep the cache only while the text it holds is a prefix of ``target``.

        A cache that diverges is rebuilt rather than trimmed: trimming keeps buffers the
        predictor would have to re-derive, and a rebuild keeps predicted == actual by
        construction. The cost is one prefill of the conversation, paid only when a turn
        diverges from what the cache holds (regenerate, stop strings, templates that
        reformat an answer), never on a plain next turn.
        """
        if self.chunks and not target.startswith(self.cached_text):
            self.reset()

    def cancel(self) -> None:
        """Stop the current turn, or the next one if none is running yet."""
        self._cancel.set()

    def stats(self) -> Stats:
        """A snapshot of the cache between turns."""
        return self._stats(0, 0, 0.0, 0.0)

    # -- generation --------------------------------------------------------------------
    def run(self, prompt_text: str, settings: GenerationSettings) -> Iterator[Event]:
        """Generate a continuation of ``prompt_text`` (the whole conversation so far).

        Yields PrefillProgress, TokenDelta and Notice events, then one Finished.
        """
        if not prompt_text:
            raise UserError("the prompt is empty; type something to send")
        finished = False
        try:
            for event in self._run(prompt_text, settings):
                finished = isinstance(event, Finished)
                yield event
        except BaseException:
            # A turn that failed (or was abandoned) half-way leaves the cache out of step
            # with the chunks; after its Finished event the cache is consistent.
            if not finished:
                self.reset()
            raise
        finally:
            self._cancel.clear()  # a cancel covers one turn

    def _run(self, prompt_text: str, settings: GenerationSettings) -> Iterator[Event]:
        self._keep_if_prefix_of(prompt_text)
        if self.chunks and self.cached_text == prompt_text:
            # All of it is cached, but sampling needs the last token's logits: refeed.
            self.reset()
        new_text = prompt_text[len(self.cached_text) :]
        new_ids = self._encode(new_text, first=not self.chunks)
        yield from self._overflow_check(new_ids)
        if not self.chunks:  # the overflow check may have rebuilt the cache
            new_text = prompt_text
            new_ids = self._encode(new_text, first=True)
        yield from self._generate(new_text, new_ids, settings)

    def _overflow_check(self, new_ids: list[int]) -> Iterator[Event]:
        from mlxkv.memory.context import past_trained_context

        limit = self.loaded.context_length
        needed = self.cached_tokens + len(new_ids)
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

    def _generate(self, new_text: str, new_ids: list[int], s: GenerationSettings):
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
            room = limit - self.cached_tokens - len(new_ids)
            if room < max_tokens:
                max_tokens, capped = max(room, 1), True

        # Chunked prefill of all but the last token (with progress and cancel);
        # mlx-lm's generate_step does the last token and the decoding.
        tic = time.perf_counter()
        total, done = len(new_ids), 0
        prompt = mx.array(new_ids)
        while total - done > 1:
            n = min(prefill_chunk(self.caches, s.prefill_step), total - done - 1)
            model(prompt[None, done : done + n], cache=self.caches)
            mx.eval([c.state for c in self.caches])
            done += n
            self.kv.advance(n, chunk=n)
            yield PrefillProgress(done, total, self._stats(done, 0, 0.0, 0.0))
            if self._cancel.is_set():
                self.chunks.append(_Chunk(tokenizer.decode(new_ids[:done]), done))
                stats = self._stats(done, 0, 0.0, 0.0, "cancelled")
                yield Finished("", "cancelled", stats)
                return
        self.chunks.append(_Chunk(new_text, total))
        answer = _Chunk("", 0)
        self.chunks.append(answer)

        detok = tokenizer.detokenizer
        detok.reset()
        stop = StopMatcher(s.stop)
        eos = set(tokenizer.eos_token_ids)
        gen_ids: list[int] = []
        shown, text, reason = 0, "", None
        prompt_tps = gen_tps = 0.0
        steps = generate_step(
            prompt[done:],
            model,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=self.caches,
        )
        self.kv.advance(1, chunk=1)  # the last prompt token
        for token, _ in steps:
            # generate_step feeds each token to the cache before yielding it.
            gen_ids.append(token)
            answer.tokens += 1
            self.kv.advance(1, chunk=1)
            now = time.perf_counter()
            if len(gen_ids) == 1:
                prompt_tps, tic = total / (now - tic), now
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
            yield TokenDelta(delta, token, self._stats(total, len(gen_ids), prompt_tps, gen_tps))
            if self._cancel.is_set():
                reason = "cancelled"
                break
        if reason is None:
            reason = "context" if capped else "length"
        if reason != "stop_string":
            detok.finalize()
            text = detok.text
        # The cache holds every generated token, stop strings and EOS included.
        answer.text = tokenizer.decode(gen_ids)
        stats = self._stats(total, len(gen_ids), prompt_tps, gen_tps, reason)
        if shown < len(text):
            yield TokenDelta(text[shown:], -1, stats)
        yield Finished(text, reason, stats)

    def _stats(self, prompt_tokens, n_gen, prompt_tps, gen_tps, reason=None) -> Stats:
        return self.kv.snapshot(
            Stats(
                prompt_tokens=prompt_tokens,
                generation_tokens=n_gen,
                prompt_tps=prompt_tps,
                generation_tps=gen_tps,
                context_limit=self.loaded.context_length,
                policy=self.policy.describe(),
                finish_reason=reason,
            )
        )
