"""Conversations on disk: every change read back by the next owner of the folder, a line a
crash cut short dropped, grown files written again, one owner at a time, and files that
are not the server's own, or not readable, left exactly as they were."""

from __future__ import annotations

import json

import pytest

from mlxkv.files import FolderBusy
from mlxkv.server.conversation_files import SLACK, ConversationFiles
from mlxkv.server.conversation_store import Conversation, ConversationStore

ID = "conv_" + "ab" * 12
OTHER = "conv_" + "cd" * 12


def _item(n: int, text: str = "x") -> dict:
    return {"id": f"msg_{n}", "type": "message", "role": "user", "content": text}


def _open(folder, logged: list[str] | None = None) -> tuple[ConversationStore, ConversationFiles]:
    files = ConversationFiles(folder, (logged if logged is not None else []).append)
    store = ConversationStore(journal=files)
    store.load(files.load(store.limit))
    return store, files


def _state(store: ConversationStore) -> dict:
    return {c.id: (c.created_at, c.metadata, c.items, c.size) for c in store.conversations.values()}


def test_every_change_is_read_back_by_the_next_server(tmp_path):
    store, files = _open(tmp_path)
    one = Conversation(ID, {"topic": "é"}, [_item(1)], created_at=1700000000)
    store.create(one)
    store.add(one, [_item(2), _item(3, "ü" * 3)])
    assert store.remove(one, "msg_1")
    store.set_metadata(one, {"topic": "capitals"})
    two = Conversation(OTHER, {})
    store.create(two)
    assert store.delete(OTHER)
    files.close()
    lines = (tmp_path / f"{ID}.jsonl").read_text().splitlines()
    assert [next(iter(json.loads(line))) for line in lines] == [
        "conversation",
        "items",
        "items",
        "removed",
        "metadata",
    ]
    assert not (tmp_path / f"{OTHER}.jsonl").exists()
    again, _ = _open(tmp_path)
    assert _state(again) == _state(store)
    assert again.bytes == store.bytes


def test_a_line_cut_short_by_a_crash_is_dropped_and_the_file_written_again(tmp_path):
    store, files = _open(tmp_path)
    one = Conversation(ID, {}, [_item(1)])
    store.create(one)
    files.close()
    path = tmp_path / f"{ID}.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"items":[{"id":"msg_2","ty')  # the crash came mid-line
    again, files = _open(tmp_path)
    assert _state(again) == _state(store)
    assert path.read_bytes().endswith(b"\n")
    again.add(again.get(ID), [_item(3)])  # the next change is a line of its own
    files.close()
    third, _ = _open(tmp_path)
    assert [i["id"] for i in third.get(ID).items] == ["msg_1", "msg_3"]


def test_a_file_that_grew_past_twice_what_it_holds_is_written_again(tmp_path):
    store, files = _open(tmp_path)
    one = Conversation(ID, {}, [])
    store.create(one)
    big = "y" * 4000
    for n in range(40):  # 40 adds and removes of 4 kB: 320 kB of lines for an empty list
        store.add(one, [_item(n, big)])
        store.remove(one, f"msg_{n}")
    path = tmp_path / f"{ID}.jsonl"
    assert path.stat().st_size <= 2 * one.size + SLACK + 4100
    store.add(one, [_item(99)])
    files.close()
    again, _ = _open(tmp_path)
    assert _state(again) == _state(store)


def test_one_server_owns_the_folder_at_a_time(tmp_path):
    _, files = _open(tmp_path)
    with pytest.raises(FolderBusy, match="in use by another mlxkv server"):
        ConversationFiles(tmp_path, print)
    files.close()
    ConversationFiles(tmp_path, print).close()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"[" * 100_000 + b"\n", "its first line is not the header"),
        (b"[" * 10 + b"\n", "its first line is not the header"),
        (b'{"conversation":' * 100_000 + b"\n", "maximum recursion depth"),
        (b"\xff\xfe\n", "its first line is not the header"),
        (b"", "it is empty"),
        (b'{"conversation":{"id":"conv_x","created_at":1,"metadata":{}}}\n', "not the header"),
        (
            b'{"conversation":{"id":"ID","created_at":1,"metadata":{}}}\n{"items":[1]}\n',
            "line 2 is not a change",
        ),
        (
            b'{"conversation":{"id":"ID","created_at":1,"metadata":{}}}\n{"boom":1}\n',
            "line 2 is not a change",
        ),
        (
            b'{"conversation":{"id":"ID","created_at":1,"metadata":{}}}\nnot json\n{}\n',
            "Expecting value",
        ),
    ],
)
def test_a_file_that_cannot_be_read_is_skipped_and_left_as_it_was(tmp_path, content, why):
    path = tmp_path / f"{ID}.jsonl"
    content = content.replace(b'"ID"', f'"{ID}"'.encode())
    path.write_bytes(content)
    foreign = tmp_path / "notes.txt"
    foreign.write_bytes(b"the user's own file")
    logged: list[str] = []
    store, _ = _open(tmp_path, logged)
    assert store.conversations == {}
    assert len(logged) == 1 and logged[0].startswith(f"conversations: skipped {ID}.jsonl: ")
    assert why in logged[0]
    assert path.read_bytes() == content and foreign.read_bytes() == b"the user's own file"


def test_files_past_the_store_bound_are_not_loaded(tmp_path):
    path = tmp_path / f"{ID}.jsonl"
    head = {"conversation": {"id": ID, "created_at": 1, "metadata": {}}}
    content = json.dumps(head) + "\n" + json.dumps({"items": [_item(1, "z" * 5000)]}) + "\n"
    path.write_text(content)
    logged: list[str] = []
    files = ConversationFiles(tmp_path, logged.append)
    assert files.load(limit=4000) == []
    assert logged == [f"conversations: {ID}.jsonl not loaded: the store's 0 MiB are full"]
    assert path.read_text() == content
