"""Files kept for OpenAI's Files API (``/v1/files``): the batch input files clients upload
and the output and error files of the server's batches, in one folder (``--files-dir``) so
that they outlive the server.

``file-<24 hex>`` holds a file's bytes and ``file-<24 hex>.json`` what the file object says
of it (name, purpose, time, when it expires). An upload is written whole to a temporary
file, fsynced and renamed in before its description is; a batch's result file grows a line
at a time (each appended whole, fsynced). A file past its ``expires_at`` is gone to clients
at once and removed by :meth:`FileStore.expire` (the batch runner's sweep). One server at a
time owns the folder (a lock on its ``.lock`` file). Only names a server gives are read or
removed; anything else is left alone, and a description that does not read as one is
skipped.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import BinaryIO

from mlxkv.errors import UserError, first_line
from mlxkv.files import (
    OwnedFolder,
    atomic_file,
    parse_json,
    read_bytes,
    sync_folder,
    write_fd,
)

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
DESCRIPTION_LIMIT = 64 * 2**10  # bytes of a description file read back
FILE_LIMIT = 200 * 10**6  # bytes of an upload: OpenAI's limit for a batch input file
LIFETIMES = (3600, 30 * 86400)  # a file's expires_after seconds: OpenAI's bounds (1 h to 30 days)
UPLOAD_LIFETIME = 30 * 86400  # an upload's life unless it says: OpenAI's for batch files


class FileStore(OwnedFolder):
    """The folder's files, by id."""

    def path(self, file_id: str) -> Path:
        return self.folder / file_id

    def add(
        self, filename: str, purpose: str, source: BinaryIO, lifetime: int | None = None
    ) -> dict:
        """A new file with the bytes of ``source`` (read to its end), expiring ``lifetime``
        seconds after it is made (None: kept until deleted)."""
        file_id = _new_id()
        try:
            with atomic_file(self.path(file_id), "file", overwrite=False, new_mode=0o600) as f:
                shutil.copyfileobj(source, f, 2**20)
        except UserError as e:
            raise OSError(first_line(e)) from None
        return self._describe(file_id, filename, purpose, lifetime)

    def start(self, filename: str, purpose: str, lifetime: int | None = None) -> dict:
        """A new empty file that :meth:`append` grows (a batch's output)."""
        file_id = _new_id()
        write_fd(os.open(self.path(file_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), b"")
        return self._describe(file_id, filename, purpose, lifetime)

    def append(self, file_id: str, data: bytes) -> None:
        # no O_CREAT: a file removed meanwhile is an error, not a new file
        write_fd(os.open(self.path(file_id), os.O_WRONLY | os.O_APPEND), data)

    def get(self, file_id: str) -> dict | None:
        """The file object of ``file_id``, None when the folder holds no such file or it
        has expired."""
        described = self._read(file_id)
        return None if described is None or _expired(described, time.time()) else described

    def _read(self, file_id: str) -> dict | None:
        if not FILE_ID.fullmatch(file_id):
            return None
        try:
            size = self.path(file_id).stat().st_size
            described = parse_json(
                read_bytes(self.folder / f"{file_id}.json", DESCRIPTION_LIMIT).decode(),
                "description",
            )
        except (OSError, UserError, UnicodeDecodeError):
            return None
        if not _is_description(described, file_id):
            return None
        return {**described, "bytes": size}

    def all(self) -> list[dict]:
        """Every file's object (but those expired), the oldest first."""
        found, now = [], time.time()
        for path in self.folder.iterdir():
            if path.suffix == ".json" and FILE_ID.fullmatch(path.stem):
                described = self._read(path.stem)
                if described is None:
                    self.log(f"files: skipped {path.name}: it does not describe a file")
                    continue
                if _expired(described, now):
                    continue
                with contextlib.suppress(OSError):  # (the time a second cannot tell apart)
                    found.append((described["created_at"], path.stat().st_mtime_ns, described))
        return [described for *_, described in sorted(found, key=lambda f: f[:2])]

    def expire(self, keep: set[str]) -> list[str]:
        """The files past their ``expires_at`` removed (but those in ``keep``: files a
        running batch reads or writes); their ids."""
        gone, now = [], time.time()
        for path in self.folder.iterdir():
            if path.suffix == ".json" and FILE_ID.fullmatch(path.stem) and path.stem not in keep:
                described = self._read(path.stem)
                if described is not None and _expired(described, now):
                    self.delete(path.stem)
                    gone.append(path.stem)
        return gone

    def delete(self, file_id: str) -> None:
        # the description last: a file whose removal stopped midway is still listed
        self.path(file_id).unlink(missing_ok=True)
        (self.folder / f"{file_id}.json").unlink(missing_ok=True)
        sync_folder(self.folder)

    def _describe(self, file_id: str, filename: str, purpose: str, lifetime: int | None) -> dict:
        now = int(time.time())
        described = {
            "id": file_id,
            "object": "file",
            "created_at": now,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None if lifetime is None else now + lifetime,
            "status_details": None,
        }
        try:
            self.write_json(f"{file_id}.json", described)
        except OSError:
            self.path(file_id).unlink(missing_ok=True)
            raise
        return {**described, "bytes": self.path(file_id).stat().st_size}


def _new_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def _expired(described: dict, now: float) -> bool:
    expires = described.get("expires_at")
    return expires is not None and expires <= now


def _is_description(v, file_id: str) -> bool:
    return (
        isinstance(v, dict)
        and v.get("id") == file_id
        and v.get("object") == "file"
        and type(v.get("created_at")) is int
        and isinstance(v.get("filename"), str)
        and isinstance(v.get("purpose"), str)
        and (v.get("expires_at") is None or type(v.get("expires_at")) is int)
    )
