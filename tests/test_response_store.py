"""The store of Responses API responses: conversations read back along their links, a bound
in bytes that pushes out the entries used longest ago, and a broken chain named."""

from __future__ import annotations

import json

import pytest

from mlxkv.server.response_store import ChainBroken, ResponseStore


def turn(store: ResponseStore, rid: str, text: str, previous: str | None = None) -> None:
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]
    store.put({"id": rid}, [{"id": f"msg_{rid}"}], messages, previous)


def size(rid: str, text: str) -> int:
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]
    return len(json.dumps([{"id": rid}, [{"id": f"msg_{rid}"}], messages]))


def test_a_conversation_is_its_turns_oldest_first():
    store = ResponseStore()
    turn(store, "a", "one")
    turn(store, "b", "two", previous="a")
    turn(store, "c", "three", previous="b")
    assert [m["content"] for m in store.conversation("c")] == [
        "one",
        "ONE",
        "two",
        "TWO",
        "three",
        "THREE",
    ]
    assert [m["content"] for m in store.conversation("a")] == ["one", "ONE"]
    assert store.bytes == size("a", "one") + size("b", "two") + size("c", "three")


def test_the_bound_pushes_out_what_was_used_longest_ago():
    store = ResponseStore(limit=size("a", "x") * 3)
    for rid in "abc":
        turn(store, rid, "x")
    store.get("a")  # used: now the newest
    turn(store, "d", "x")
    assert list(store.entries) == ["c", "a", "d"]
    assert store.bytes == size("a", "x") * 3
    assert store.delete("c") and not store.delete("c")
    assert store.usage() == {"responses": 2, "bytes": size("a", "x") * 2, "limit": store.limit}


def test_an_entry_larger_than_the_store_is_not_kept():
    store = ResponseStore(limit=10)
    turn(store, "a", "a long turn")
    assert store.get("a") is None and store.bytes == 0


def test_a_broken_chain_names_its_missing_link():
    store = ResponseStore()
    turn(store, "a", "one")
    turn(store, "b", "two", previous="a")
    store.delete("a")
    with pytest.raises(ChainBroken) as e:
        store.conversation("b")
    assert (e.value.missing, e.value.asked) == ("a", "b")
    with pytest.raises(ChainBroken) as e:
        store.conversation("nope")
    assert (e.value.missing, e.value.asked) == ("nope", "nope")


def test_the_bound_counts_bytes_not_characters():
    store = ResponseStore()
    turn(store, "a", "日本")  # two characters, three bytes each (and their upper case)
    assert store.bytes == size("a", "xx") + 2 * 2 * 2


def test_a_later_state_of_a_response_replaces_its_first():
    """A background response is stored queued, then finished: one entry, its bytes
    counted once."""
    store = ResponseStore()
    turn(store, "a", "x")
    turn(store, "a", "a longer answer")
    assert list(store.entries) == ["a"] and store.bytes == size("a", "a longer answer")
    assert [m["content"] for m in store.conversation("a")] == ["a longer answer", "A LONGER ANSWER"]


def test_a_stored_items_id_finds_it_until_its_response_goes():
    """Input and output items by id (what item_reference names); a response's later state
    keeps them, and a deleted or pushed-out response's items are found no more."""
    store = ResponseStore(limit=size("a", "one") + size("b", "two") + 10)
    output = [{"id": "fc_1", "type": "function_call", "name": "f"}]
    store.put({"id": "a", "output": output}, [{"id": "msg_a"}], [], None)
    assert store.item("fc_1") == output[0] and store.item("msg_a") == {"id": "msg_a"}
    turn(store, "b", "two")
    assert store.item("msg_b") == {"id": "msg_b"} and store.item("nope") is None
    turn(store, "c", "three")  # pushes "a" out
    assert store.get("a") is None and store.item("fc_1") is None and store.item("msg_a") is None
    assert store.delete("b") and store.item("msg_b") is None
    assert store.item("msg_c") == {"id": "msg_c"}
