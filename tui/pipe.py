"""Worker -> UI hand-off that never blocks the worker.

The worker appends items (engine events and job results) and wakes the UI with one
message only when the queue goes from empty to non-empty; the UI drains everything queued
in one go. Per-token cost on the worker is a lock and a deque append, and a UI that falls
behind gets larger batches instead of a growing backlog of messages.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Status:
    """Progress text from a job (e.g. model loading steps)."""

    job: str
    message: str


@dataclass(frozen=True)
class Progress:
    """How far a job's current step is (e.g. bytes of weights loaded)."""

    job: str
    done: int
    total: int


@dataclass(frozen=True)
class Done:
    job: str
    result: object = None


@dataclass(frozen=True)
class Failed:
    job: str
    message: str  # one line for the user


class EventPipe:
    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._armed = False

    def put(self, item) -> None:
        with self._lock:
            self._items.append(item)
            wake, self._armed = not self._armed, True
        if wake:
            self._wake()

    def drain(self) -> list:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._armed = False
        return items
