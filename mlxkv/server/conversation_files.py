"""Conversations kept on disk, so that they outlive the server: each in its own file of JSON
lines in one folder (``--conversation-dir``), a line appended and fsynced per change:

    {"conversation": {"id": ..., "created_at": ..., "metadata": {...}}}   the first line
    {"items": [...]}                                                      items added
    {"removed": "ITEM_ID"}                                                an item deleted
    {"metadata": {...}}                                                   new labels

A deleted conversation's file is removed. A file whose lines have grown to more than twice
what they hold is written again whole (to a new file, fsynced, then renamed over it), and so
is one whose last line a crash cut short. One server at a time owns the folder (a lock on
its ``.lock`` file). Only files named as a server names them (``conv_<24 hex>.jsonl``) are
read, rewritten or removed; anything else in the folder is left alone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from mlxkv.errors import first_line
from mlxkv.files import OwnedFolder, sync_folder, write_fd
from mlxkv.server.conversation_store import Conversation

OWN_FILE = re.compile(r"conv_[0-9a-f]{24}\.jsonl")
SLACK = 64 * 2**10  # a file may outgrow twice what it holds by this much before a rewrite


class ConversationFiles(OwnedFolder):
    def __init__(self, folder: Path, log: Callable[[str], None]):
        super().__init__(folder, log)
        self.sizes: dict[str, int] = {}  # each file's bytes

    def path(self, conversation_id: str) -> Path:
        return self.folder / f"{conversation_id}.jsonl"

    def load(self, limit: int) -> list[Conversation]:
        """The conversations of the folder's files, as many as ``limit`` bytes of files
        hold; a file that cannot be read is skipped (and left as it is), with a line why."""
        out, total = [], 0
        for path in sorted(self.folder.iterdir()):
            if not OWN_FILE.fullmatch(path.name):
                continue
            try:
                size = path.stat().st_size
                if total + size > limit:
                    self.log(
                        f"conversations: {path.name} not loaded: the store's "
                        f"{limit // 2**20} MiB are full"
                    )
                    continue
                conversation, cut = _read(path)
            except (OSError, ValueError, RecursionError) as e:
                self.log(f"conversations: skipped {path.name}: {first_line(e)}")
                continue
            total += size
            self.sizes[conversation.id] = size
            if cut:  # the last change was not whole: what was kept is written again
                self.rewrite(conversation)
            out.append(conversation)
        return out

    def created(self, conversation: Conversation) -> None:
        data = _whole(conversation)
        # a new name: no file is ever overwritten
        fd = os.open(self.path(conversation.id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        write_fd(fd, data)
        sync_folder(self.folder)
        self.sizes[conversation.id] = len(data)

    def added(self, conversation: Conversation, items: list[dict]) -> None:
        self._append(conversation, {"items": items})

    def removed(self, conversation: Conversation, item_id: str) -> None:
        self._append(conversation, {"removed": item_id})

    def relabelled(self, conversation: Conversation, metadata: dict) -> None:
        self._append(conversation, {"metadata": metadata})

    def deleted(self, conversation_id: str) -> None:
        self.sizes.pop(conversation_id, None)
        self.path(conversation_id).unlink(missing_ok=True)

    def settle(self, conversation: Conversation) -> None:
        """After a change: the file written again whole when its lines outgrew it."""
        if self.sizes.get(conversation.id, 0) > 2 * conversation.size + SLACK:
            self.rewrite(conversation)

    def rewrite(self, conversation: Conversation) -> None:
        path = self.path(conversation.id)
        data = _whole(conversation)
        new = path.with_name(path.name + ".new")
        new.unlink(missing_ok=True)  # a rewrite a crash left unfinished
        write_fd(os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), data)
        os.replace(new, path)
        sync_folder(self.folder)
        self.sizes[conversation.id] = len(data)

    def _append(self, conversation: Conversation, change: dict) -> None:
        data = _line(change)
        # no O_CREAT: a file removed behind the server's back is an error, not a new file
        write_fd(os.open(self.path(conversation.id), os.O_WRONLY | os.O_APPEND), data)
        self.sizes[conversation.id] = self.sizes.get(conversation.id, 0) + len(data)


def _whole(conversation: Conversation) -> bytes:
    """A file's lines for the conversation as it stands: its header, then its items."""
    head = {
        "id": conversation.id,
        "created_at": conversation.created_at,
        "metadata": conversation.metadata,
    }
    data = _line({"conversation": head})
    return data + _line({"items": conversation.items}) if conversation.items else data


def _line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _read(path: Path) -> tuple[Conversation, bool]:
    """The conversation a file holds, and whether its last line was cut short (dropped)."""
    lines = path.read_bytes().split(b"\n")
    cut = lines.pop() != b""  # every whole line ends with a newline
    if not lines:
        raise ValueError("it is empty")
    head = json.loads(lines[0]).get("conversation") if lines[0].startswith(b"{") else None
    if not isinstance(head, dict) or head.get("id") != path.stem:
        raise ValueError(f"its first line is not the header of conversation {path.stem}")
    created = head.get("created_at")
    if type(created) is not int:
        raise ValueError("its header has no created_at time")
    conversation = Conversation(path.stem, _labels(head.get("metadata")), [], created)
    for number, line in enumerate(lines[1:], 2):
        change = json.loads(line)
        if not isinstance(change, dict) or len(change) != 1:
            raise ValueError(f"line {number} is not a change")
        ((kind, value),) = change.items()
        if kind == "items" and isinstance(value, list) and all(map(_is_item, value)):
            conversation.items += value
        elif kind == "removed" and isinstance(value, str):
            conversation.items = [i for i in conversation.items if i["id"] != value]
        elif kind == "metadata":
            conversation.metadata = _labels(value)
        else:
            raise ValueError(f"line {number} is not a change")
    return conversation, cut


def _is_item(item) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get("id"), str)
        and isinstance(item.get("type"), str)
    )


def _labels(v) -> dict:
    if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
        raise ValueError("its metadata is not an object of strings")
    return v
