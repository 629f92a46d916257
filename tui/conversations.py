"""Conversations kept as they go: one JSON file per chat under the mlxkv home.

Each file is rewritten whole after every change, atomically (a temporary file in the
same folder, fsync, rename), so a crash or a kill leaves the previous version, never a
half-written one. Only files this store created are ever rewritten.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.paths import home
from mlxkv.policy import KVPolicy

SUFFIX = ".json"


def chats_dir() -> Path:
    return home() / "chats"


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new file, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        atomic_write(self.current, json.dumps(data, indent=2, ensure_ascii=False))
        return self.current

    def list(self) -> list[Saved]:
        """Kept conversations, newest first (unreadable files are skipped)."""
        out = []
        for path in self.folder.glob(f"chat-*{SUFFIX}"):
            try:
                data = read_conversation(path)
            except UserError:
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
    """The KV policy a conversation was saved with (PolicyError if it is not valid)."""
    names = {f.name for f in fields(KVPolicy)}
    return KVPolicy(**{k: v for k, v in data.items() if k in names})


def _describe(policy: dict) -> str:
    try:
        return policy_from_dict(policy).describe()
    except (UserError, TypeError):  # a policy this version cannot read is still listed
        return "?"


def read_conversation(path: Path) -> dict:
    """A conversation file, checked; a Markdown export is refused with what it is."""
    path = Path(path)
    if path.suffix.lower() in (".md", ".markdown"):
        raise UserError(
            f"{path} is a Markdown export (for reading), not a conversation; "
            "load the .json file saved with /save PATH.json, or pick one from /history"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot load conversation {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"cannot load conversation {path}: not UTF-8 text (byte {e.start}); "
            "it is not a conversation file"
        ) from None
    if text.lstrip().startswith("# Chat with"):
        raise UserError(
            f"{path} is a Markdown export (for reading), not a conversation; "
            "load a .json conversation instead"
        )
    try:
        data = json.loads(text)
        messages = [{"role": m["role"], "content": m["content"]} for m in data["messages"]]
    except (ValueError, KeyError, TypeError):
        raise UserError(
            f"cannot load conversation {path}: not a conversation file (JSON with a "
            "'messages' list of {role, content})"
        ) from None
    bad = {m["role"] for m in messages} - {"user", "assistant"}
    if bad:
        raise UserError(f"cannot load conversation {path}: unknown role(s) {sorted(bad)}")
    return {**data, "messages": messages}
