"""The responses a server keeps (Responses API ``store: true``), so a client can go on from
one with ``previous_response_id`` instead of sending the conversation again, and read it
back (``GET /v1/responses/{id}``).

Each entry holds its own turn only (the input items and the answer, as the chat messages
a template reads) and the id of the response before it: a conversation is the chain of its
turns, read back by following the links. The store lives in memory and is bounded in bytes
(the oldest untouched entries go first); with a ``Journal`` (``response_files``) each entry
kept is written down first, each one dropped removed, and a restarted server reads them
back.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

STORE_BYTES = 64 * 2**20
UNFINISHED = ("queued", "in_progress")  # a background response's states before its end


@dataclass
class Stored:
    response: dict  # the response object as the client got it
    items: list[dict]  # the request's input items, each with an id
    messages: list[dict]  # this turn's input and answer as chat messages
    previous: str | None  # the response this one went on from
    size: int


class ChainBroken(KeyError):
    """A response of the chain is not held (never stored, deleted, or evicted)."""

    def __init__(self, missing: str, asked: str):
        super().__init__(missing)
        self.missing, self.asked = missing, asked


class Journal(Protocol):
    """Where each entry is written down before the store keeps it."""

    def kept(self, response_id: str, record: dict) -> None: ...
    def dropped(self, response_id: str) -> None: ...


class ResponseStore:
    def __init__(self, limit: int = STORE_BYTES, journal: Journal | None = None):
        self.limit = limit
        self.journal = journal
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.owners: dict[str, str] = {}  # item id -> the response whose input or output it is

    def put(
        self,
        response: dict,
        items: list[dict],
        messages: list[dict],
        previous: str | None,
        written: bool = False,
    ) -> None:
        """Keep a response (``written``: read back from the journal, not written again);
        an OSError from the journal leaves the store as it was."""
        # bytes as UTF-8 (a character may take four)
        size = len(json.dumps([response, items, messages], ensure_ascii=False).encode())
        if size > self.limit:  # larger than the whole store: kept nowhere, as with store false
            self.delete(response["id"])
            return
        if self.journal is not None and not written:  # (a later state replaces the first)
            record = {"response": response, "items": items, "messages": messages}
            self.journal.kept(response["id"], {**record, "previous": previous})
        self._forget(response["id"])
        entry = self.entries[response["id"]] = Stored(response, items, messages, previous, size)
        self.bytes += size
        for item in _items(entry):
            self.owners[item["id"]] = response["id"]
        while self.bytes > self.limit:  # the oldest untouched go
            oldest = next(iter(self.entries))
            try:
                self.delete(oldest)
            except OSError:  # its file stays; a restart drops it again
                self._forget(oldest)

    def load(self, records: list[dict]) -> None:
        """Entries read back from the journal, the oldest first (past the limit the oldest
        go, their files with them)."""
        for r in records:
            self.put(r["response"], r["items"], r["messages"], r["previous"], written=True)

    def get(self, response_id: str) -> Stored | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        if response_id not in self.entries:
            return False
        if self.journal is not None:
            self.journal.dropped(response_id)
        return self._forget(response_id)

    def _forget(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        for item in _items(entry):
            if self.owners.get(item["id"]) == response_id:
                del self.owners[item["id"]]
        return True

    def item(self, item_id: str) -> dict | None:
        """An input or output item of a stored response, by its id."""
        entry = self.entries.get(self.owners.get(item_id, ""))
        if entry is None:
            return None
        return next((i for i in _items(entry) if i["id"] == item_id), None)

    def __len__(self) -> int:
        return len(self.entries)

    def usage(self) -> dict:
        return {"responses": len(self.entries), "bytes": self.bytes, "limit": self.limit}

    def conversation(self, response_id: str) -> list[dict]:
        """The messages of every turn up to and including ``response_id``'s, oldest first;
        the whole chain counts as used. Raises ChainBroken naming the first missing link."""
        turns, at, seen = [], response_id, set()
        while at is not None and at not in seen:
            seen.add(at)
            entry = self.get(at)
            if entry is None:
                raise ChainBroken(at, response_id)
            turns.append(entry.messages)
            at = entry.previous
        return [m for turn in reversed(turns) for m in turn]


def _items(entry: Stored) -> list[dict]:
    return [*entry.items, *entry.response.get("output", [])]
