"""Anthropic answers built from an answer's parts (``mlxkv.server.messages.Message``): the
blocks and the exact stream events, without a model or a server (the server tests in
tests/test_serve_messages.py run the same code on real answers)."""

from __future__ import annotations

import json

from mlxkv.engine.events import Stats
from mlxkv.server.answers import Choice, Part
from mlxkv.server.messages import Message, event

CALL = {
    "index": 0,
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def finished(reason: str, calls=(), stop=None) -> Choice:
    c = Choice(0, finish_reason=reason, stop=stop)
    c.calls = list(calls)
    c.stats = Stats(prompt_tokens=30, prompt_tokens_cached=20, generation_tokens=9)
    return c


def test_blocks_open_in_the_order_written_and_blank_text_makes_none():
    m = Message("m")
    parts = [
        Part(reasoning="Think"),
        Part(reasoning="ing."),
        Part(text="\n\n"),  # after </think>: no block of its own
        Part(text="Sure"),
        Part(text="."),
        Part(text="\n", calls=[CALL]),
        Part(text="  "),  # after the call: dropped, as no text follows
    ]
    ev = [e for p in parts for e in m.add(p)] + m.end(finished("stop", [CALL]))
    assert ev == [
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": "",
                                                   "signature": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "thinking_delta", "thinking": "Think"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "thinking_delta", "thinking": "ing."}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "\n\nSure"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "."}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "\n"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("content_block_start", {"type": "content_block_start", "index": 2,
                                 "content_block": {"type": "tool_use", "id": "call_1",
                                                   "name": "get_weather", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2,
                                 "delta": {"type": "input_json_delta",
                                           "partial_json": '{"city": "Paris"}'}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0,
                                     "cache_read_input_tokens": 20, "output_tokens": 9,
                                     "mlxkv": {"kv_tokens": 0, "kv_bytes_actual": 0,
                                               "kv_bytes_predicted": None,
                                               "policy": "full"}}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    whole = m.whole(finished("stop", [CALL]))
    assert whole["content"] == [
        {"type": "thinking", "thinking": "Thinking.", "signature": ""},
        {"type": "text", "text": "\n\nSure.\n"},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert whole["id"].startswith("msg_") and whole["stop_reason"] == "tool_use"


def test_stop_reasons():
    def reason(finish: str, stop=None) -> tuple:
        whole = Message("m").whole(finished(finish, stop=stop))
        return whole["stop_reason"], whole["stop_sequence"]

    assert reason("stop") == ("end_turn", None)
    assert reason("stop_string", stop="###") == ("stop_sequence", "###")
    assert reason("length") == ("max_tokens", None)
    assert reason("context") == ("model_context_window_exceeded", None)


def test_omitted_thinking_keeps_the_block_without_its_text():
    m = Message("m", show_thinking=False)
    ev = m.add(Part(reasoning="secret")) + m.add(Part(reasoning="s")) + m.add(Part(text="Hi"))
    assert [name for name, _ in ev] == [
        "content_block_start",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
    ]
    assert m.whole(finished("stop"))["content"][0] == {
        "type": "thinking",
        "thinking": "",
        "signature": "",
    }


def test_a_call_whose_arguments_are_no_object_is_text():
    m = Message("m")
    odd = {**CALL, "function": {"name": "f", "arguments": '"just a string"'}}
    m.add(Part(calls=[odd]))
    (block,) = m.whole(finished("stop"))["content"]
    assert block["type"] == "text"
    assert json.loads(block["text"]) == {"name": "f", "arguments": '"just a string"'}


def test_the_start_event_and_the_wire_format():
    (start,) = Message("m").start(Stats(prompt_tokens=12, prompt_tokens_cached=4))
    assert start[1]["message"]["usage"] == {
        "input_tokens": 8,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 0,
    }
    assert event("message_stop", {"type": "message_stop"}) == (
        'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
