"""The engine as the chat UI sees it: one object over ChatSession + a generator.

Every method except ``cancel`` is called on the MLX worker thread (see tui.worker).
The generator comes from an *opener*, so tests can swap in a scripted one that satisfies
the same ``ChatGenerator`` protocol while the conversation logic (ChatSession) stays real.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from mlxkv.engine.chat import ChatSession
from mlxkv.engine.events import Event, Stats
from mlxkv.engine.sampling import chat_sampling
from mlxkv.engine.session import GenerationSettings
from mlxkv.errors import UserError
from mlxkv.policy import KVPolicy
from tui.conversations import SAVED_SAMPLING


class ChatGenerator(Protocol):
    """What the chat needs of a generator: the real ``mlxkv.engine.session.Session``
    and the tests' scripted one both satisfy it (tests/test_tui_units.py checks)."""

    loaded: object  # .name, .tokenizer, .context_length, .path
    policy: KVPolicy

    def run(self, prompt_text: str, settings: GenerationSettings) -> Iterator[Event]: ...

    def check_prompt_length(self, characters: int) -> None: ...

    def cancel(self) -> None: ...

    def reset(self) -> None: ...

    def set_policy(self, policy: KVPolicy) -> None: ...

    def stats(self) -> Stats: ...


SPANS_LIMIT = 100  # messages whose evicted shares are measured (message_spans is quadratic)

# opener(model, policy, on_status, on_progress) -> a ChatGenerator
Opener = Callable[
    [str | None, KVPolicy, Callable[[str], None], Callable[[int, int], None]], ChatGenerator
]


def real_opener(
    dtype: str = "auto",
    force: bool = False,
    overflow: str = "stop",
    draft_tokens: int = 0,
    chat_template=None,  # mlxkv.models.chat_template.ChatTemplate: --chat-template(-args)
) -> Opener:
    def open_generator(model, policy, on_status, on_progress):
        from mlxkv.engine.loading import open_model
        from mlxkv.engine.session import Session

        loaded = open_model(
            model,
            dtype,
            policy,
            force,
            on_status=on_status,
            on_progress=on_progress,
            chat_template=chat_template,
        )
        return Session(loaded, policy, overflow=overflow, draft_tokens=draft_tokens)

    return open_generator


class ChatEngine:
    def __init__(
        self,
        opener: Opener,
        settings: GenerationSettings,
        policy: KVPolicy | None = None,
        system: str = "",
        budget: int | None = None,  # memory budget in bytes; None: ask the machine
        given: set[str] | frozenset = frozenset(),  # sampling fields set on the command line
    ):
        self._open = opener
        self._settings = settings
        self._given = set(given)
        self.sampling_source = "command line"
        self._policy = policy or KVPolicy()
        self._system = system
        self.chat: ChatSession | None = None
        self.owner: int | None = None  # the one thread that runs MLX work (set on first use)
        self._budget = budget
        self.model_arg: str | None = None  # the MODEL the chat was opened with

    def _mark(self) -> None:
        """MLX work stays on one thread (streams are per thread): the first caller owns it."""
        me = threading.get_ident()
        if self.owner is None:
            self.owner = me
        elif me != self.owner:
            raise RuntimeError("engine work must run on the chat's MLX worker thread")

    # -- model -----------------------------------------------------------------------------
    def open(
        self,
        model: str | None,
        on_status: Callable[[str], None],
        on_progress: Callable[[int, int], None] = lambda _d, _t: None,
        policy: KVPolicy | None = None,
    ) -> None:
        """Load ``model`` (under ``policy``, default the current one); the conversation and
        system prompt carry over to it. If loading fails the previous model stays."""
        from mlxkv.memory import system_memory

        self._mark()
        if self._budget is None:
            # What MLX may use, read before the weights take their share (as plan does).
            self._budget = system_memory().available
        generator = self._open(model, policy or self.policy, on_status, on_progress)
        self.model_arg = model
        old = self.chat
        system = old.system if old else self._system
        path = getattr(generator.loaded, "path", None)
        settings, self.sampling_source = chat_sampling(self._settings, self._given, path)
        self.chat = ChatSession(generator, settings, system=system)
        if old is not None:
            self.chat.messages = list(old.messages)
        self._policy = generator.policy

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

    @property
    def settings(self) -> GenerationSettings:
        return self.chat.settings if self.chat else self._settings

    def set_sampling(self, **values) -> GenerationSettings:
        """Change sampling for the next turns (UserError if a value is out of range)."""
        settings = replace(self.settings, **values)
        self._settings = replace(self._settings, **values)
        self._given |= set(values)
        if self.chat:
            self.chat.settings = settings
        return settings

    def idle_stats(self) -> Stats:
        """Panel figures between turns (what the cache holds now)."""
        self._mark()
        return self.chat.generator.stats()

    # -- turns -----------------------------------------------------------------------------
    def _stream(self, events: Iterator[Event], stop: threading.Event) -> Iterator[Event]:
        for ev in events:
            if stop.is_set():  # a stop that came before the generator cleared its flag
                self.chat.cancel()
            yield ev

    def send(self, text: str, stop: threading.Event) -> Iterator[Event]:
        """One turn; if it fails, ChatSession takes the message back and the generator
        drops what the cache half-held, so the caller only shows the error."""
        self._mark()
        yield from self._stream(self.chat.send(text), stop)

    def regenerate(self, stop: threading.Event) -> Iterator[Event]:
        self._mark()
        yield from self._stream(self.chat.regenerate(), stop)

    def cancel(self) -> None:
        """Thread-safe: stops the running generation at its next step."""
        if self.chat is not None:
            self.chat.cancel()

    # -- what the cache no longer holds ------------------------------------------------------
    def message_spans(self) -> list[tuple[int, int]]:
        """Token positions [start, end) of each message in the conversation as the model
        reads it (system prompt and template included)."""
        tok = self.chat.generator.loaded.tokenizer
        head = [{"role": "system", "content": self.system}] if self.system else []
        spans, start, msgs = [], 0, self.chat.messages
        if head:
            start = len(_encode(tok, head))
        for i in range(len(msgs)):
            end = len(_encode(tok, head + msgs[: i + 1]))
            if i == 0:  # a template may add its own system prompt before the first message
                own = len(tok.encode(msgs[0]["content"], add_special_tokens=False)) + 2
                start = max(start, end - own)
            spans.append((start, max(end, start)))
            start = end
        return spans

    def evicted(self, stats: Stats) -> list[float] | None:
        """Per message, the share of its tokens the cache has dropped (0: all kept); None
        past SPANS_LIMIT messages (a template render per message would take minutes)."""
        if not stats.kv_evicted or self.policy.window is None:
            return [0.0] * len(self.messages)
        if len(self.messages) > SPANS_LIMIT:
            return None
        lo = self.policy.sinks
        hi = lo + stats.kv_evicted  # the tokens after the sinks went first
        out = []
        for start, end in self.message_spans():
            start = max(start, lo)  # the sink tokens stay: they are the template's first
            gone = max(0, min(end, hi) - start)
            out.append(gone / (end - start) if end > start else 0.0)
        return out

    def reread_tokens(self) -> int:
        """Tokens the next turn reads if the cache is dropped now (the conversation)."""
        if not self.chat or not self.chat.messages:
            return 0
        return len(_encode(self.chat.generator.loaded.tokenizer, self.chat._all_messages()))

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

    def set_policy(self, policy: KVPolicy) -> bool:
        """Raises UserError (PolicyError) if the model cannot use ``policy``; the old
        policy and cache then stay. The same policy keeps the cache (returns False)."""
        self._mark()
        if policy == self.chat.generator.policy:
            return False
        self.chat.generator.set_policy(policy)
        self._policy = policy
        return True

    def to_dict(self) -> dict:
        data = self.chat.to_dict()
        data["model_arg"] = self.model_arg  # what to open again on resume
        data["sampling"] = {k: getattr(self.settings, k) for k in SAVED_SAMPLING}
        return data

    def save(self, path: Path) -> None:
        path = Path(path)
        try:
            self.chat.save(path)
        except FileExistsError:  # a file, or a link (even to nothing): never written through
            raise UserError(
                f"{path} exists; give a new file name (nothing was overwritten)"
            ) from None
        except OSError as e:
            raise UserError(f"cannot save to {path}: {e.strerror or e}") from None

    def restore(self, data: dict) -> None:
        """Take the messages, system prompt and sampling of a conversation
        (read_conversation's result); the cache is rebuilt on the next turn."""
        self._mark()
        self.chat.system = data.get("system", "") or ""
        self._system = self.chat.system
        self.chat.messages = list(data["messages"])
        self.chat.generator.reset()
        saved = data.get("sampling") or {}  # checked by read_conversation
        values = {
            k: saved[k]
            for k in SAVED_SAMPLING
            if saved.get(k) is not None and k not in self._given  # the command line wins
        }
        if values:
            self.set_sampling(**values)
            self.sampling_source = "saved conversation"


def _encode(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return tokenizer.encode(text, add_special_tokens=False)
