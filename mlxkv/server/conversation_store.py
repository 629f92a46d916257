"""The conversations a server keeps (OpenAI's Conversations API): each an ordered list of
Responses items (messages, calls, their outputs, reasoning) that a client adds to and reads,
and that a response made with ``conversation`` reads as the turns before its input and adds
its input and output to.

A conversation is the client's own record, so none is pushed out to make room: the store is
bounded in bytes, and past the bound new conversations and items are refused until the client
deletes some. It lives in memory; with a ``Journal`` (``conversation_files``) each change is
written down before it is made, and a restarted server reads the conversations back.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Protocol

CONVERSATIONS_BYTES = 64 * 2**20


@dataclass
class Conversation:
    id: str
    metadata: dict
    items: list[dict] = field(default_factory=list)
    created_at: int = field(default_factory=lambda: int(time.time()))
    size: int = 0

    def resource(self) -> dict:
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    def item(self, item_id: str) -> dict | None:
        return next((i for i in self.items if i["id"] == item_id), None)


class Journal(Protocol):
    """Where each change is written down before the store makes it."""

    def created(self, conversation: Conversation) -> None: ...
    def added(self, conversation: Conversation, items: list[dict]) -> None: ...
    def removed(self, conversation: Conversation, item_id: str) -> None: ...
    def relabelled(self, conversation: Conversation, metadata: dict) -> None: ...
    def deleted(self, conversation_id: str) -> None: ...
    def settle(self, conversation: Conversation) -> None: ...


class ConversationStore:
    def __init__(self, limit: int = CONVERSATIONS_BYTES, journal: Journal | None = None):
        self.limit = limit
        self.journal = journal
        self.conversations: dict[str, Conversation] = {}
        self.bytes = 0

    def load(self, conversations: list[Conversation]) -> None:
        """Conversations read back from the journal."""
        for conversation in conversations:
            self.conversations[conversation.id] = conversation
            self._resize(conversation)

    def fits(self, items: list[dict], metadata: dict | None = None) -> bool:
        return self.bytes + _size(items, metadata or {}) <= self.limit

    def create(self, conversation: Conversation) -> None:
        if self.journal is not None:
            self.journal.created(conversation)
        self.conversations[conversation.id] = conversation
        self._resize(conversation)

    def get(self, conversation_id: str) -> Conversation | None:
        return self.conversations.get(conversation_id)

    def delete(self, conversation_id: str) -> bool:
        if conversation_id not in self.conversations:
            return False
        if self.journal is not None:
            self.journal.deleted(conversation_id)
        self.bytes -= self.conversations.pop(conversation_id).size
        return True

    def add(self, conversation: Conversation, items: list[dict]) -> None:
        """Appends ``items`` (a conversation deleted meanwhile takes nothing)."""
        if self.conversations.get(conversation.id) is not conversation:
            return
        if self.journal is not None:
            self.journal.added(conversation, items)
        conversation.items += items
        self._resize(conversation)

    def remove(self, conversation: Conversation, item_id: str) -> bool:
        kept = [i for i in conversation.items if i["id"] != item_id]
        if len(kept) == len(conversation.items):
            return False
        if self.journal is not None:
            self.journal.removed(conversation, item_id)
        conversation.items = kept
        self._resize(conversation)
        return True

    def set_metadata(self, conversation: Conversation, metadata: dict) -> None:
        if self.journal is not None:
            self.journal.relabelled(conversation, metadata)
        conversation.metadata = metadata
        self._resize(conversation)

    def __len__(self) -> int:
        return len(self.conversations)

    def usage(self) -> dict:
        return {
            "conversations": len(self.conversations),
            "bytes": self.bytes,
            "limit": self.limit,
        }

    def _resize(self, conversation: Conversation) -> None:
        size = _size(conversation.items, conversation.metadata)
        self.bytes += size - conversation.size
        conversation.size = size
        if self.journal is not None and conversation.id in self.conversations:
            self.journal.settle(conversation)


def _size(items: list[dict], metadata: dict) -> int:
    """Bytes as UTF-8 JSON (a character may take four)."""
    return len(json.dumps([items, metadata], ensure_ascii=False).encode())
