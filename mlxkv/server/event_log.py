"""The stream events of background responses created with ``stream: true``, kept so a
client whose connection dropped can read them again from where it left off
(``GET /v1/responses/{id}?stream=true&starting_after=N``), while the answer runs and after.

Each log holds its events as the server-sent text it sent, numbered from 0 by their
``sequence_number``. The logs are bounded in bytes: when they pass the bound, the logs of
ended answers go, oldest first (one still answering is kept whole: a reader is following it).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

LOGS_BYTES = 16 * 2**20


class EventLog:
    """One answer's events, read by any number of readers from any point."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.bytes = 0
        self.ended = False
        self._more = asyncio.Event()  # set (and replaced) at each change

    def add(self, events: list[str]) -> None:
        self.events += events
        self.bytes += sum(len(e.encode()) for e in events)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._more.set()
        self._more = asyncio.Event()

    async def read(self, after: int = -1):
        """The events numbered above ``after``: those written, then each as it comes, until
        the answer ends."""
        at = max(after + 1, 0)
        while True:
            more = self._more
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.ended:
                return
            await more.wait()


class EventLogs:
    """The kept logs, by response id."""

    def __init__(self, limit: int = LOGS_BYTES):
        self.limit = limit
        self.logs: OrderedDict[str, EventLog] = OrderedDict()

    def open(self, response_id: str) -> EventLog:
        self.trim()
        log = self.logs[response_id] = EventLog()
        return log

    def get(self, response_id: str) -> EventLog | None:
        return self.logs.get(response_id)

    def drop(self, response_id: str) -> None:
        self.logs.pop(response_id, None)

    def trim(self) -> None:
        """Drops ended logs, oldest first, until the logs fit their bound."""
        total = sum(log.bytes for log in self.logs.values())
        for response_id, log in list(self.logs.items()):
            if total <= self.limit:
                return
            if log.ended:
                total -= log.bytes
                del self.logs[response_id]
