"""The batch output file: an append-only JSONL log that a re-run resumes from.

The file is the user's: nothing in it is rewritten, and only a torn final record is ever
cut. On open the whole file is read and checked *before* anything changes: every line must
be a batch record, else the run is refused and the file is left as it was. Bytes after the
last newline are kept when they form a complete record (a newline is appended first) and
cut only when they are the start of a record that a kill interrupted. Each record is one
``write()`` of a whole line to a file opened with O_APPEND, then fsync'd, so a kill -9
leaves at most one torn line and a finished record survives a power cut. An exclusive lock
stops two runs appending to the same file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from pathlib import Path

from mlxkv.commands.batch_resume import FINGERPRINT_FIELD, ResumeRecord
from mlxkv.errors import UserError

# Every record starts with one of these (json.dumps of a dict whose first key is id or line).
_RECORD_STARTS = (b'{"id": ', b'{"line": ')
_RECORD_HEAD = re.compile(rb'\{("id": (-?\d+|"([^"\\]|\\.)*"), )?"line": \d')


def parse_record(raw: bytes) -> ResumeRecord | None:
    """One output line -> the record it holds, or None if it is not a batch record."""
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
        return None
    if not isinstance(rec, dict):
        return None
    line, ident, fp = rec.get("line"), rec.get("id"), rec.get(FINGERPRINT_FIELD)
    if "custom_id" in rec:  # the record of an OpenAI batch line (batch_openai.py)
        ident = rec["custom_id"]
        has_text = isinstance(rec.get("response"), dict)
        has_error = isinstance(rec.get("error"), dict)
    else:  # an answer's text, or an embeddings line's vectors
        has_text = isinstance(rec.get("text"), str) or isinstance(rec.get("embeddings"), list)
        has_error = isinstance(rec.get("error"), str)
    if not (isinstance(line, int) and not isinstance(line, bool) and line >= 1):
        return None
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
        return None
    if fp is not None and not isinstance(fp, str):
        return None
    if has_text == has_error:
        return None
    return ResumeRecord(line, ident, fp, has_error)


def read_records(data: bytes, name: str) -> tuple[list[ResumeRecord], int, bool]:
    """Check a whole output file's bytes without changing anything.

    Returns (records, torn_bytes, needs_newline): ``torn_bytes`` is the length of an
    interrupted final record to cut; ``needs_newline`` is set when the last line is a
    complete record without its newline. Raises UserError (naming the line) when the file
    holds anything but batch records."""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends in a newline
    records = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        rec = parse_record(raw)
        if rec is None:
            raise UserError(
                f"output {name} line {n} is not a batch record; it is left untouched "
                "(give another -o file)"
            )
        records.append(rec)
    if not tail.strip():
        return records, 0, False
    rec = parse_record(tail)
    if rec is not None:
        return [*records, rec], 0, True
    if tail.startswith(_RECORD_STARTS) and _is_torn_json(tail):
        # Ours if records come before it, or if it got as far as a record's "line" field.
        if records or _RECORD_HEAD.match(tail):
            return records, len(tail), False
    raise UserError(
        f"output {name} line {len(lines) + 1} is not a batch record; it is left untouched "
        "(give another -o file)"
    )


def _is_torn_json(tail: bytes) -> bool:
    """True if ``tail`` is not whole JSON: with the record start checked by the caller,
    the beginning of a record that a kill cut short."""
    try:
        json.loads(tail)
    except ValueError:
        return True
    return False


class ResultLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.existing: list[ResumeRecord] = []  # records found on open, in file order
        self.records = 0  # records in the file now
        self.torn_bytes = 0  # bytes of a torn last line removed on open
        self._fd: int | None = None

    # -- opening: check, lock, read back, and only then repair -----------------------------
    def open(self) -> ResultLog:
        parent = self.path.parent
        if not parent.is_dir():
            raise UserError(f"output directory {parent} does not exist; create it first")
        if self.path.is_dir():
            raise UserError(f"output {self.path} is a directory; give a file path")
        if self.path.exists() and not self.path.is_file():
            raise UserError(f"output {self.path} is not a regular file; give a file path")
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
        with open(self._fd, "rb", closefd=False) as f:
            f.seek(0)
            data = f.read()
        records, torn, needs_newline = read_records(data, str(self.path))
        if torn:
            os.ftruncate(self._fd, len(data) - torn)
            self.torn_bytes = torn
        elif needs_newline:
            self._write(b"\n")
        self.existing = records
        self.records = len(records)

    # -- writing ---------------------------------------------------------------------------
    def append(self, record: dict) -> None:
        """Write one record as one line and fsync it (nothing buffered survives a crash)."""
        text = json.dumps(record, ensure_ascii=False)
        try:
            data = (text + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (an error record's id): keep it escaped
            data = (json.dumps(record) + "\n").encode("ascii")
        self._write(data)
        self.records += 1

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as e:
            why = "the disk is full" if e.errno == errno.ENOSPC else e.strerror
            raise UserError(
                f"cannot write to {self.path}: {why}; the {self.records} records before "
                "are safe, re-run the same command to resume"
            ) from None

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
