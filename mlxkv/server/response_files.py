"""Stored responses kept on disk, so that a conversation chained by
``previous_response_id`` outlives the server: each entry of the response store in its own
file (``resp_<24 hex>.json`` in ``--responses-dir``), written whole to a new file, fsynced
and renamed in (a background response's later state replaces its first), and removed when
the store drops the entry (deleted, or pushed out by newer ones). One server at a time owns
the folder (a lock on its ``.lock`` file); only files named as a server names them are read
or removed, and one that does not read as an entry is skipped and left alone.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from mlxkv.errors import UserError, first_line
from mlxkv.files import OwnedFolder, parse_json, read_bytes, sync_folder
from mlxkv.server.response_store import UNFINISHED

OWN_FILE = re.compile(r"resp_[0-9a-f]{24}\.json")


class ResponseFiles(OwnedFolder):
    def kept(self, response_id: str, record: dict) -> None:
        self.write_json(f"{response_id}.json", record)

    def dropped(self, response_id: str) -> None:
        self._path(response_id).unlink(missing_ok=True)
        sync_folder(self.folder)

    def load(self, limit: int) -> list[dict]:
        """The entries of the folder's files, the oldest written first (a file larger than
        the whole store, ``limit``, is not read). A background response the server stopped
        in reads as failed: nothing answers it any more."""
        found = []
        for path in self.folder.iterdir():
            if not OWN_FILE.fullmatch(path.name):
                continue
            try:
                record = parse_json(read_bytes(path, limit).decode(), "entry")
                if not _is_record(record, path.stem):
                    raise ValueError("it does not hold a stored response")
                found.append((path.stat().st_mtime_ns, path.name, record))
            except (OSError, UserError, ValueError) as e:
                self.log(f"responses: skipped {path.name}: {first_line(e)}")
        records = [record for *_, record in sorted(found, key=lambda f: f[:2])]
        for record in records:
            response = record["response"]
            if response.get("status") in UNFINISHED:
                response["status"] = "failed"
                response["error"] = {
                    "code": "server_error",
                    "message": "the server stopped before this background response ended",
                }
                with contextlib.suppress(OSError):
                    self.kept(response["id"], record)
        return records

    def _path(self, response_id: str) -> Path:
        return self.folder / f"{response_id}.json"


def _is_record(v, response_id: str) -> bool:
    return (
        isinstance(v, dict)
        and isinstance(v.get("response"), dict)
        and v["response"].get("id") == response_id
        and isinstance(v["response"].get("output", []), list)
        and isinstance(v.get("items"), list)
        and isinstance(v.get("messages"), list)
        and all(isinstance(m, dict) for m in v["messages"])
        and all(
            isinstance(i, dict) and isinstance(i.get("id"), str)
            for i in [*v["items"], *v["response"].get("output", [])]
        )
        and (v.get("previous") is None or isinstance(v.get("previous"), str))
    )
