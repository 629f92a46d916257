"""Stored responses on disk: a chain read back by a new store on the same folder, the
bound's evictions and deletes removing their files, a background response the server
stopped in read back as failed, a write that fails leaving the store as it was, and the
folder's other or crafted files left alone."""

from __future__ import annotations

import json

import pytest

from mlxkv.files import FolderBusy
from mlxkv.server.response_files import ResponseFiles
from mlxkv.server.response_store import ResponseStore


def rid(n: int) -> str:
    return f"resp_{n:024x}"


def turn(store: ResponseStore, n: int, text: str, previous: int | None = None, **more) -> None:
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]
    response = {"id": rid(n), "status": "completed", "output": [{"id": f"msg_{n}"}], **more}
    store.put(response, [{"id": f"in_{n}"}], messages, None if previous is None else rid(previous))


def reopened(folder, limit: int = 2**20) -> ResponseStore:
    files = ResponseFiles(folder, print)
    store = ResponseStore(limit, journal=files)
    store.load(files.load(limit))
    return store


def test_a_chain_outlives_its_store_and_a_deleted_turn_stays_deleted(tmp_path):
    files = ResponseFiles(tmp_path, print)
    store = ResponseStore(journal=files)
    turn(store, 1, "one")
    turn(store, 2, "two", previous=1)
    turn(store, 3, "three", previous=2)
    turn(store, 4, "gone")
    assert store.delete(rid(4))
    files.close()

    again = reopened(tmp_path)
    assert [m["content"] for m in again.conversation(rid(3))] == [
        "one",
        "ONE",
        "two",
        "TWO",
        "three",
        "THREE",
    ]
    assert again.get(rid(4)) is None
    assert again.item("msg_2") == {"id": "msg_2"} and again.item("in_1") == {"id": "in_1"}
    assert again.bytes == store.bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"] + [
        f"{rid(n)}.json" for n in (1, 2, 3)
    ]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in tmp_path.glob("resp_*"))


def test_the_bound_removes_the_files_of_what_it_pushes_out(tmp_path):
    store = ResponseStore(limit=700, journal=ResponseFiles(tmp_path, print))
    for n in range(1, 6):
        turn(store, n, f"turn {n}")
    kept = sorted(int(p.stem[5:], 16) for p in tmp_path.glob("resp_*.json"))
    assert kept == sorted(int(k[5:], 16) for k in store.entries) and len(kept) < 5
    assert kept[-1] == 5


def test_a_background_response_the_server_stopped_in_reads_as_failed(tmp_path):
    store = ResponseStore(journal=ResponseFiles(tmp_path, print))
    turn(store, 1, "slow", status="in_progress", background=True)
    store.journal.close()
    again = reopened(tmp_path)
    response = again.get(rid(1)).response
    assert (response["status"], response["error"]) == (
        "failed",
        {
            "code": "server_error",
            "message": "the server stopped before this background response ended",
        },
    )
    assert json.loads((tmp_path / f"{rid(1)}.json").read_text())["response"] == response


def test_a_write_that_fails_leaves_the_store_as_it_was(tmp_path):
    store = ResponseStore(journal=ResponseFiles(tmp_path, print))
    turn(store, 1, "kept")
    (tmp_path / f"{rid(2)}.json").mkdir()  # what its file would replace cannot be replaced
    with pytest.raises(OSError, match="is not a regular file"):
        turn(store, 2, "not kept")
    assert list(store.entries) == [rid(1)] and store.item("in_2") is None


def test_other_and_crafted_files_are_skipped_and_left_alone(tmp_path):
    store = ResponseStore(journal=ResponseFiles(tmp_path, print))
    turn(store, 1, "mine")
    store.journal.close()
    strangers = {
        "notes.txt": b"the user's",
        "resp_1.json": b"{}",
        f"{rid(2)}.json": json.dumps({"response": {"id": rid(9)}, "items": [], "messages": []}),
        f"{rid(3)}.json": b"[" * 100_000,
        f"{rid(4)}.json": json.dumps(
            {"response": {"id": rid(4), "output": [1]}, "items": [], "messages": []}
        ),
        f"{rid(5)}.json": b"\xff\xfe",
    }
    for name, data in strangers.items():
        (tmp_path / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    again = reopened(tmp_path)
    assert list(again.entries) == [rid(1)]
    for name, data in strangers.items():
        assert (tmp_path / name).read_bytes() == (
            data if isinstance(data, bytes) else data.encode()
        )
    with pytest.raises(FolderBusy):
        ResponseFiles(tmp_path, print)
