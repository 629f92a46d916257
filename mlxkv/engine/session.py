"""A session: one model, one cache policy, and the token ids its caches hold.

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

A turn runs on the engine's scheduler (:mod:`mlxkv.engine.scheduler`) as a request that
carries this session: the scheduler asks the session to :meth:`Session.prepare` its caches
for the prompt, prefills and decodes in them, and feeds every generated token back, so the
next turn starts where this one ended. A session made without a scheduler gets a private
one, driven by the thread that reads the turn's events.

Failure recovery lives here: a turn that breaks off while the model runs (an exception)
may leave layers out of step, so the caches are rebuilt; one that stops between model calls
(a cancel, or a caller that walks away) keeps them, and ``tokens`` stays exact.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from mlxkv.engine.events import Event, Failed, Notice, Stats
from mlxkv.engine.kv_stats import KVAccounting
from mlxkv.engine.request import (
    GenerationSettings,
    check_prompt_characters,
    encode_prompt,
    most_prompt_characters,
)
from mlxkv.engine.reuse import Checkpoint, cache_identity, keep_prefix, load_held, save_held
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.errors import UserError
from mlxkv.models.loader import LoadedModel
from mlxkv.policy import KVPolicy

__all__ = ["GenerationSettings", "Session", "encode_prompt"]

OVERFLOW_CHOICES = ("stop", "slide")


@dataclass
class Session:
    """One conversation's caches on one model; ``cancel()`` is safe from any thread."""

    loaded: LoadedModel
    policy: KVPolicy = field(default_factory=KVPolicy)
    overflow: str = "stop"  # at the context limit: stop, or slide into a sink window
    scheduler: Scheduler | None = None  # None: a private one, driven by the caller
    draft_tokens: int = 0  # the private scheduler's (see Scheduler)

    def __post_init__(self):
        if self.overflow not in OVERFLOW_CHOICES:
            raise UserError(f"--on-overflow must be one of {', '.join(OVERFLOW_CHOICES)}")
        from mlxkv.caches import check_policy

        check_policy(self.loaded.model, self.policy)
        if self.scheduler is None:
            self.scheduler = Scheduler(
                self.loaded, self.policy, max_batch=1, draft_tokens=self.draft_tokens
            )
        self._cancel = threading.Event()
        self._handle = None
        self.reset()

    # -- cache bookkeeping -------------------------------------------------------------
    def reset(self) -> None:
        """Drop the cache (and everything it held)."""
        from mlxkv.caches import make_caches

        reserve = self.scheduler.undo_reserve(self.policy)
        self._install(make_caches(self.loaded.model, self.policy, reserve=reserve), [])

    def _install(self, caches: list, tokens: list[int]) -> None:
        from mlxkv.caches import always_exact

        self.caches = caches
        self.tokens: list[int] = list(tokens)  # the ids the caches hold, in order
        self._checkpoint: Checkpoint | None = None
        self.needs_checkpoint = not all(always_exact(c) for c in caches)
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
        handle = self._handle
        if handle is not None:
            handle.cancel()

    def stats(self) -> Stats:
        """A snapshot of the cache between turns."""
        return self.kv.snapshot(
            Stats(context_limit=self.loaded.context_length, policy=self.policy.describe())
        )

    # -- prompt caches on disk ----------------------------------------------------------
    def identity(self) -> dict:
        """What a saved cache must match to be used here: the model by its content (config,
        weights, tokenizer; never its name), the policy and the dtype."""
        return dict(cache_identity(self.loaded), policy=self.policy.to_dict())

    def save_cache(self, path) -> None:
        """Write the caches, their token ids and the turn-boundary copy to ``path``
        (atomically), so that a later session can go back as far as this one could."""
        meta = dict(self.identity(), model=self.loaded.name)
        save_held(path, self.caches, self.tokens, self._checkpoint, meta)

    def load_cache(self, path) -> None:
        """Take the caches and token ids saved at ``path``, every part checked against this
        model and policy first; :class:`CacheError` (one line) otherwise (this session is
        then unchanged)."""
        caches, tokens, cp = load_held(path, self.identity(), self.loaded.model, self.policy)
        self._install(caches, tokens)
        self._checkpoint = cp

    # -- what the scheduler asks of a session ---------------------------------------------
    def prepare(self, ids: list[int]) -> int:
        """Make the caches hold the longest usable prefix of ``ids``; returns its length."""
        held = keep_prefix(self.caches, self.tokens, self._checkpoint, ids)
        if held is None:
            self.reset()
            return 0
        return held

    def take_checkpoint(self) -> None:
        """Copy the caches' states at the turn boundary (the prompt without its last token)."""
        from mlxkv.caches import snapshot

        self._checkpoint = Checkpoint(list(self.tokens), snapshot(self.caches))

    def recover(self, in_model: bool) -> None:
        """After a turn broke off: keep the caches when they hold exactly ``tokens``."""
        held = {c.tokens_seen for c in self.caches if hasattr(c, "tokens_seen")}
        if in_model or held - {len(self.tokens)}:
            self.reset()

    # -- generation --------------------------------------------------------------------
    def run(self, prompt_text: str, settings: GenerationSettings) -> Iterator[Event]:
        """Generate a continuation of ``prompt_text`` (the whole conversation so far)."""
        if not prompt_text:
            raise UserError("the prompt is empty; type something to send")
        self.check_prompt_length(len(prompt_text))
        return self.run_tokens(encode_prompt(self.loaded.tokenizer, prompt_text), settings)

    def run_tokens(self, ids: list[int], settings: GenerationSettings) -> Iterator[Event]:
        """Generate a continuation of the prompt ``ids`` (the whole conversation so far).

        Yields PrefillProgress, TokenDelta and Notice events, then one Finished. A request
        the engine refuses raises :class:`UserError`; an error inside the model is raised
        as it came.
        """
        if not ids:
            raise UserError("the prompt is empty; type something to send")
        try:
            yield from self._overflow_check(list(ids))
            request = Request(list(ids), settings, policy=self.policy, session=self)
            self._handle = handle = self.scheduler.submit(request)
            if self._cancel.is_set():
                handle.cancel()
            for ev in handle.events():
                if isinstance(ev, Failed):
                    if handle.error is not None:
                        raise handle.error
                    raise UserError(ev.message)
                yield ev
        finally:
            self._handle = None
            self._cancel.clear()  # a cancel covers one turn

    def check_prompt_length(self, characters: int) -> None:
        """Refuse, before the tokenizer reads it, a prompt of more characters than the
        context can hold in tokens (when it stops at the context, without a window)."""
        if self.overflow != "stop" or self.policy.window is not None:
            return
        check_prompt_characters(
            characters,
            self._most_characters,
            self.loaded.context_length,
            "shorten it (or clear the chat), use a window (--kv-window) or --on-overflow slide",
        )

    @functools.cached_property
    def _most_characters(self) -> int | None:
        return most_prompt_characters(self.loaded.tokenizer, self.loaded.context_length)

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
