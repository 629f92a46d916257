"""The conversation store's bound: bytes counted as items and labels change, none pushed
out, and what would pass the bound refused."""

from __future__ import annotations

import json

from mlxkv.server.conversation_store import Conversation, ConversationStore


def _bytes(items: list[dict], metadata: dict) -> int:
    return len(json.dumps([items, metadata], ensure_ascii=False).encode())


def test_the_store_counts_each_change_and_refuses_past_its_bound():
    store = ConversationStore(limit=300)
    a = {"id": "msg_a", "type": "message", "role": "user", "content": "é" * 20}
    one = Conversation("conv_1", {"k": "v"}, [a])
    store.create(one)
    assert store.bytes == _bytes([a], {"k": "v"})  # "é" is two bytes
    b = {"id": "msg_b", "type": "message", "role": "user", "content": "x" * 30}
    store.add(one, [b])
    assert store.bytes == _bytes([a, b], {"k": "v"})
    assert store.remove(one, "msg_a") and not store.remove(one, "msg_a")
    store.set_metadata(one, {})
    assert store.bytes == _bytes([b], {})
    big = {"id": "msg_c", "content": "y" * 250}
    assert store.fits([b]) and not store.fits([big])
    two = Conversation("conv_2", {})
    store.create(two)
    store.delete("conv_1")
    store.add(one, [b])  # deleted meanwhile: takes nothing
    assert store.get("conv_1") is None and store.bytes == _bytes([], {})
    assert store.usage() == {"conversations": 1, "bytes": _bytes([], {}), "limit": 300}
