"""The conversations a server keeps (OpenAI's Conversations API): each an ordered list of
Responses items (messages, calls, their outputs, reasoning) that a client adds to and reads,
and that a response made with ``conversation`` reads as the turns before its input and adds
its input and output to.

A conversation is the client's own record, so none is pushed out to make room: the store is
bounded in bytes, and past the bound new conversations and items are refused until the client
deletes some. It lives in memory: a restart empties it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

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


class ConversationStore:
    def __init__(self, limit: int = CONVERSATIONS_BYTES):
        self.limit = limit
        self.conversations: dict[str, Conversation] = {}
        self.bytes = 0

    def fits(self, items: list[dict], metadata: dict | None = None) -> bool:
        return self.bytes + _size(items, metadata or {}) <= self.limit

    def create(self, conversation: Conversation) -> None:
        self.conversations[conversation.id] = conversation
        self._resize(conversation)

    def get(self, conversation_id: str) -> Conversation | None:
        return self.conversations.get(conversation_id)

    def delete(self, conversation_id: str) -> bool:
        conversation = self.conversations.pop(conversation_id, None)
        if conversation is not None:
            self.bytes -= conversation.size
        return conversation is not None

    def add(self, conversation: Conversation, items: list[dict]) -> None:
        """Appends ``items`` (a conversation deleted meanwhile takes nothing)."""
        if self.conversations.get(conversation.id) is conversation:
            conversation.items += items
            self._resize(conversation)

    def remove(self, conversation: Conversation, item_id: str) -> bool:
        kept = [i for i in conversation.items if i["id"] != item_id]
        if len(kept) == len(conversation.items):
            return False
        conversation.items = kept
        self._resize(conversation)
        return True

    def set_metadata(self, conversation: Conversation, metadata: dict) -> None:
        conversation.metadata = metadata
        self._resize(conversation)

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


def _size(items: list[dict], metadata: dict) -> int:
    """Bytes as UTF-8 JSON (a character may take four)."""
    return len(json.dumps([items, metadata], ensure_ascii=False).encode())
