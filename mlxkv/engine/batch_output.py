"""The batch output file: an append-only JSONL log that a re-run resumes from.

Crash safety rests on three things: each record is one ``write()`` of a whole line to a
file opened with O_APPEND (a kill -9 leaves at most one torn line, never an interleaving);
on open, bytes after the last newline are a torn record and are truncated away (that
result is redone); and what is done is read back from the file itself, so nothing else
has to survive a crash. An exclusive lock stops two runs appending to the same file.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from mlxkv.engine.batch_input import id_key
from mlxkv.errors import UserError


class ResultLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.done_ids: set[tuple] = set()  # id_key of every id with a record
        self.done_lines: set[int] = set()  # input line of every record
        self.records = 0
        self.torn_bytes = 0  # bytes of a torn last line removed on open
        self._fd: int | None = None

    # -- opening: check, lock, repair, read back -------------------------------------------
    def open(self) -> ResultLog:
        parent = self.path.parent
        if not parent.is_dir():
            raise UserError(f"output directory {parent} does not exist; create it first")
        if self.path.is_dir():
            raise UserError(f"output {self.path} is a directory; give a file path")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise UserError(f"cannot open output {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UserError(
                f"output {self.path} is being written by another mlxkv batch; wait for it"
            ) from None
        self._fd = fd
        try:
            self._read_back()
        except BaseException:
            self.close()
            raise
        return self

    def _read_back(self) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            # A record is written as one line ending in "\n": a tail without one is torn.
            os.ftruncate(self._fd, end)
            self.torn_bytes = len(data) - end
            data = data[:end]
        for n, raw in enumerate(data.splitlines(), 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                line = rec["line"]
            except (ValueError, KeyError, TypeError):
                raise UserError(
                    f"output {self.path} line {n} is not a batch record; "
                    "is this the right output file?"
                ) from None
            self.done_lines.add(line)
            if "id" in rec:
                self.done_ids.add(id_key(rec["id"]))
            self.records += 1

    # -- writing ---------------------------------------------------------------------------
    def append(self, record: dict) -> None:
        """Write one record as one line, now (no buffering survives a crash)."""
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self.done_lines.add(record["line"])
        if "id" in record:
            self.done_ids.add(id_key(record["id"]))
        self.records += 1

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError:
                pass
            os.close(self._fd)  # also releases the lock
            self._fd = None

    def __enter__(self) -> ResultLog:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
