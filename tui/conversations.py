"""Conversations kept as they go: one JSON file per chat under the mlxkv home.

Each file is rewritten whole after every change, atomically (a temporary file in the
same folder, fsync, rename), so a crash or a kill leaves the previous version, never a
half-written one. Only files this store created are ever rewritten.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import MiB, atomic_write, parse_json, read_text
from mlxkv.paths import home
from mlxkv.policy import (
    DEFAULT_KEY_SCHEME,
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    KVPolicy,
    PolicyError,
)

SUFFIX = ".json"
MAX_BYTES = 64 * MiB  # a conversation file larger than this is refused before it is read


def chats_dir() -> Path:
    return home() / "chats"


@dataclass(frozen=True)
class Saved:
    """One kept conversation, as /history lists it."""

    path: Path
    updated: str
    model: str
    policy: str
    messages: int
    title: str


def _title(messages: list[dict]) -> str:
    first = next((m["content"] for m in messages if m.get("role") == "user"), "")
    line = " ".join(first.split())
    return line[:60] + ("…" if len(line) > 60 else "")


class ConversationStore:
    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder else chats_dir()
        self.current: Path | None = None  # the file of the conversation on screen
        self.skipped: list[str] = []  # why files were left out of the last list()

    def start(self) -> None:
        """The next save goes to a new file (after /clear, or at start-up)."""
        self.current = None

    def resume(self, path: Path) -> dict:
        data = read_conversation(path)
        self.current = Path(path)
        return data

    def save(self, data: dict) -> Path | None:
        """Write the conversation (``ChatSession.to_dict()`` plus extras); an empty one is
        not written. Returns the file."""
        if not data.get("messages"):
            return None
        if self.current is None:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
            self.current = self.folder / f"chat-{stamp}{SUFFIX}"
        data = {**data, "updated": datetime.now().isoformat(timespec="seconds")}
        self.folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps(data, indent=2, ensure_ascii=False)
        # a conversation is private (new files 0600); one the user made read-only is kept
        atomic_write(self.current, text, "conversation", new_mode=0o600)
        return self.current

    def list(self) -> list[Saved]:
        """Kept conversations, newest first (unreadable files are skipped; ``skipped``
        says why)."""
        out = []
        self.skipped = []
        for path in self.folder.glob(f"chat-*{SUFFIX}"):
            try:
                data = read_conversation(path, policy=False)  # listed; refused on reopening
            except UserError as e:
                self.skipped.append(str(e))
                continue
            policy = data.get("policy") or {}
            out.append(
                Saved(
                    path,
                    str(data.get("updated", "")),
                    str(data.get("model", "?")),
                    _describe(policy),
                    len(data["messages"]),
                    _title(data["messages"]),
                )
            )
        return sorted(out, key=lambda s: (s.updated, s.path.name), reverse=True)

    def last(self) -> Path | None:
        saved = self.list()
        return saved[0].path if saved else None


def policy_from_dict(data: dict) -> KVPolicy:
    """The KV policy a conversation was saved with (``read_conversation`` checked it)."""
    names = {f.name for f in fields(KVPolicy)}
    return KVPolicy(**{k: v for k, v in data.items() if k in names})


def _describe(policy) -> str:
    if check_policy(policy):  # a policy this version cannot read is still listed
        return "?"
    return policy_from_dict(policy).describe()


def _int_or_none(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def check_policy(policy) -> str | None:
    """What is wrong with a saved policy (field names as saved), or None."""
    if not isinstance(policy, dict):
        return f"'policy' must be an object, got {type(policy).__name__}"
    numbers = ("window", "sinks", "bits", "group_size", "key_bits", "value_bits")
    for key in (*numbers, "value_group_size"):
        if not _int_or_none(policy.get(key)):
            return f"'policy.{key}' must be a whole number or null, got {policy[key]!r}"
    if not isinstance(policy.get("key_scheme", DEFAULT_KEY_SCHEME), str):
        return "'policy.key_scheme' must be a string"
    for key in ("bits", "key_bits", "value_bits"):
        b = policy.get(key)
        if b is not None and b not in SUPPORTED_BITS:
            bits = ", ".join(map(str, SUPPORTED_BITS))
            return f"'policy.{key}' is {b}; the KV caches take {bits} bits"
    for key in ("group_size", "value_group_size"):
        g = policy.get(key)
        if (g is not None or key == "group_size" and key in policy) and (
            g not in SUPPORTED_GROUP_SIZES
        ):
            sizes = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
            return f"'policy.{key}' is {g}; the KV caches take groups of {sizes}"
    window, sinks = policy.get("window"), policy.get("sinks") or 0
    if window is not None and window < 1:
        return f"'policy.window' is {window}; a window keeps 1 token or more"
    if sinks < 0 or (sinks and (window is None or window <= sinks)):
        return f"'policy.sinks' is {sinks}; sinks need a window larger than them"
    try:
        policy_from_dict(policy)
    except PolicyError as e:
        return f"'policy' is not valid: {e}"
    return None


SAVED_SAMPLING = ("temperature", "top_p", "repetition_penalty", "max_tokens")


def check_sampling(sampling) -> str | None:
    """What is wrong with a saved ``sampling`` object, or None."""
    from mlxkv.engine.request import GenerationSettings

    if not isinstance(sampling, dict):
        return f"'sampling' must be an object, got {type(sampling).__name__}"
    values = {k: sampling[k] for k in SAVED_SAMPLING if sampling.get(k) is not None}
    for key, v in values.items():
        whole = key == "max_tokens"
        if isinstance(v, bool) or not isinstance(v, int if whole else int | float):
            return f"'sampling.{key}' must be a {'whole ' if whole else ''}number, got {v!r}"
        if not math.isfinite(v):
            return f"'sampling.{key}' must be a finite number, got {v!r}"
    try:
        GenerationSettings(**values)
    except UserError as e:
        return f"'sampling' is not valid: {e}"
    return None


def _check(data, policy: bool) -> str | None:
    """What is wrong with a parsed conversation file (``policy``: its policy too), or None."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        return "not a conversation file (JSON with a 'messages' list of {role, content})"
    for i, m in enumerate(data["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return f"message {i + 1} is not a {{role, content}} object with text content"
        if m.get("role") not in ("user", "assistant"):
            return f"message {i + 1} has role {m.get('role')!r}; use 'user' or 'assistant'"
    for key in ("model", "model_arg", "system", "updated"):
        if data.get(key) is not None and not isinstance(data[key], str):
            return f"'{key}' must be a string, got {type(data[key]).__name__}"
    if data.get("sampling") is not None and (problem := check_sampling(data["sampling"])):
        return problem
    if policy and data.get("policy") is not None:
        return check_policy(data["policy"])
    return None


def read_conversation(path: Path, policy: bool = True) -> dict:
    """A conversation file, checked (size, nesting, every field mlxkv reads; ``policy``:
    its KV policy too); a Markdown export is refused with what it is. Every problem is a
    one-line UserError."""
    path = Path(path)
    if path.suffix.lower() in (".md", ".markdown"):
        raise UserError(
            f"{path} is a Markdown export (for reading), not a conversation; "
            "load the .json file saved with /save PATH.json, or pick one from /history"
        )
    what = f"cannot load conversation {path}"
    text = read_text(path, MAX_BYTES, "cannot load conversation")
    if text.lstrip().startswith("# Chat with"):
        raise UserError(
            f"{path} is a Markdown export (for reading), not a conversation; "
            "load a .json conversation instead"
        )
    data = parse_json(text, what, max_depth=8, utf8=True)
    problem = _check(data, policy)
    if problem:
        raise UserError(f"cannot load conversation {path}: {problem}")
    messages = [{"role": m["role"], "content": m["content"]} for m in data["messages"]]
    return {**data, "messages": messages}
