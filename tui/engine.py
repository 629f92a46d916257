"""The engine as the chat UI sees it: one object over ChatSession + Generator.

Every method except ``cancel`` is called on the MLX worker thread (see tui.worker).
The generator comes from an *opener* so tests can swap in a scripted one (tui.fake)
while the conversation logic (ChatSession) stays the real one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from mlxkv.engine.chat import ChatSession
from mlxkv.engine.events import Event, Stats
from mlxkv.errors import UserError
from mlxkv.policy import KVPolicy

# opener(model, policy, on_status) -> a Generator (or anything with its interface)
Opener = Callable[[str | None, KVPolicy, Callable[[str], None]], object]


def real_opener(dtype: str = "auto", force: bool = False, overflow: str = "stop") -> Opener:
    def open_generator(model, policy, on_status):
        from mlxkv.engine.loading import open_model
        from mlxkv.engine.session import Generator

        loaded = open_model(model, dtype, policy, force, on_status=on_status)
        return Generator(loaded, policy, overflow=overflow)

    return open_generator


class ChatEngine:
    def __init__(
        self,
        opener: Opener,
        settings,
        policy: KVPolicy | None = None,
        system: str = "",
        budget: int | None = None,  # memory budget in bytes; None: ask the machine
    ):
        self._open = opener
        self.settings = settings
        self._policy = policy or KVPolicy()
        self._system = system
        self.chat: ChatSession | None = None
        self.threads: set[int] = set()  # threads that ran engine work (the tests check: one)
        self._budget = budget

    def _mark(self) -> None:
        self.threads.add(threading.get_ident())

    # -- model -----------------------------------------------------------------------------
    def open(self, model: str | None, on_status: Callable[[str], None]) -> None:
        """Load ``model``; the conversation and system prompt carry over to it. If loading
        fails the previous model stays in use."""
        from mlxkv.memory import system_memory

        self._mark()
        if self._budget is None:
            # What MLX may use, read before the weights take their share (as plan does).
            self._budget = system_memory().available
        generator = self._open(model, self.policy, on_status)
        old = self.chat
        system = old.system if old else self._system
        self.chat = ChatSession(generator, self.settings, system=system)
        if old is not None:
            self.chat.messages = list(old.messages)

    @property
    def loaded(self) -> bool:
        return self.chat is not None

    @property
    def model_name(self) -> str:
        return self.chat.generator.loaded.name if self.chat else "no model"

    @property
    def policy(self) -> KVPolicy:
        return self.chat.generator.policy if self.chat else self._policy

    @property
    def budget(self) -> int | None:
        return self._budget

    def idle_stats(self) -> Stats:
        """Panel figures between turns (what the cache holds now)."""
        self._mark()
        g = self.chat.generator
        return g.kv.snapshot(
            Stats(context_limit=g.loaded.context_length, policy=g.policy.describe())
        )

    # -- turns -----------------------------------------------------------------------------
    def _stream(self, events: Iterator[Event], stop: threading.Event) -> Iterator[Event]:
        for ev in events:
            if stop.is_set():  # a stop that came before the generator cleared its flag
                self.chat.cancel()
            yield ev

    def send(self, text: str, stop: threading.Event) -> Iterator[Event]:
        self._mark()
        before = len(self.chat.messages)
        try:
            yield from self._stream(self.chat.send(text), stop)
        except Exception:
            # Unanswered: drop the user message so the UI can give the text back.
            msgs = self.chat.messages
            if len(msgs) == before + 1 and msgs[-1]["role"] == "user":
                msgs.pop()
            self._after_failure()
            raise

    def regenerate(self, stop: threading.Event) -> Iterator[Event]:
        self._mark()
        try:
            yield from self._stream(self.chat.regenerate(), stop)
        except Exception:
            self._after_failure()
            raise

    def _after_failure(self) -> None:
        """A turn that broke off may leave tokens in the cache that its bookkeeping does not
        list; dropping the cache costs one prefill and keeps the next turn correct."""
        try:
            self.chat.generator.reset()
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass

    def cancel(self) -> None:
        """Thread-safe: stops the running generation after its current token."""
        if self.chat is not None:
            self.chat.cancel()

    # -- conversation state ----------------------------------------------------------------
    @property
    def messages(self) -> list[dict]:
        return list(self.chat.messages) if self.chat else []

    @property
    def system(self) -> str:
        return self.chat.system if self.chat else self._system

    def set_system(self, text: str) -> None:
        self._system = text
        if self.chat:
            self.chat.system = text  # the next turn diverges from the cache: it is rebuilt

    def clear(self) -> None:
        self._mark()
        self.chat.clear()

    def set_policy(self, policy: KVPolicy) -> None:
        """Raises UserError (PolicyError) if the model cannot use ``policy``; the old
        policy and cache then stay."""
        self._mark()
        self.chat.generator.set_policy(policy)
        self._policy = policy

    def save(self, path: Path) -> None:
        try:
            self.chat.save(Path(path))
        except OSError as e:
            raise UserError(f"cannot save to {path}: {e.strerror or e}") from None

    def load(self, path: Path) -> None:
        self._mark()
        self.chat.load(Path(path))
