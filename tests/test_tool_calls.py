"""The readers that split a chat answer (tool calls on mlx-lm's own parsers, reasoning)
and the request checks of tool calling (the end-to-end path, a real model thinking and
writing a call through ``mlxkv serve``, is tests/test_serve_tools.py)."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools, mistral, pythonic

from mlxkv.server.answers import Choice
from mlxkv.server.errors import APIError
from mlxkv.server.params import Limits, parse_chat
from mlxkv.server.reasoning import ThinkReader
from mlxkv.server.tools import CallReader

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


def reader(module, parallel: bool = True) -> CallReader:
    return CallReader(
        module.tool_call_start, module.tool_call_end, module.parse_tool_call, [WEATHER], parallel
    )


def read(r: CallReader, pieces) -> tuple[str, list[dict], list[str]]:
    """Feed ``pieces`` then close: the content, the calls, and the content as sent."""
    sent, calls = [], []
    for p in pieces:
        text, found = r.feed(p)
        sent.append(text)
        calls += found
    text, found = r.close()
    sent.append(text)
    calls += found
    return "".join(sent), calls, sent


def shape(calls: list[dict]) -> list[tuple]:
    return [
        (c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ]


TWO_CALLS = (
    'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
)


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(TWO_CALLS)])
def test_calls_are_found_however_the_text_is_cut(size):
    pieces = [TWO_CALLS[i : i + size] for i in range(0, len(TWO_CALLS), size)]
    content, calls, sent = read(reader(json_tools), pieces)
    assert content == "Let me look.\n"
    assert shape(calls) == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_weather", {"city": "Oslo"}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert not any("<" in s for s in sent)  # a marker's first characters are held back


def test_text_that_only_looks_like_a_marker_is_released():
    r = reader(json_tools)
    assert r.feed("a <tool") == ("a ", [])
    assert r.feed("box> b") == ("<toolbox> b", [])
    assert r.close() == ("", [])


def test_with_parallel_calls_off_only_the_first_call_is_kept():
    _, calls, _ = read(reader(json_tools, parallel=False), [TWO_CALLS])
    assert shape(calls) == [(0, "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
        '<tool_call>{"name": get_weather}</tool_call>',  # not JSON
        '<tool_call>["get_weather"]</tool_call>',  # JSON, not a call
    ],
)
def test_a_call_the_parser_cannot_read_comes_back_as_text(text):
    r = reader(json_tools)
    content, calls, _ = read(r, [text])
    assert (content, calls) == (text, [])
    assert r.unread == [text]


def test_a_marker_with_no_end_runs_to_the_end_of_the_answer():
    """Mistral writes ``[TOOL_CALLS]`` and no end marker."""
    text = 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}get_weather[ARGS]{"city": "Rome"}'
    content, calls, _ = read(reader(mistral), list(text))
    assert content == "Sure. "
    assert shape(calls) == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_weather", {"city": "Rome"}),
    ]


def test_pythonic_calls(tmp_path):
    """LFM2's ``[f(x=1), g(y=2)]`` between its markers; read with ``ast``, never run."""
    text = (
        '<|tool_call_start|>[get_weather(city="Paris"), get_weather(city="Lima")]<|tool_call_end|>'
    )
    content, calls, _ = read(reader(pythonic), [text[:9], text[9:]])
    assert content == ""
    assert shape(calls) == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_weather", {"city": "Lima"}),
    ]
    mark = tmp_path / "ran"
    hostile = f"[__import__('os').system('touch {mark}')]"
    read(reader(pythonic), [f"<|tool_call_start|>{hostile}<|tool_call_end|>"])
    assert not mark.exists()


def ask(**body):
    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, Limits())


def test_the_request_side():
    a = ask(tools=[WEATHER], parallel_tool_calls=False)
    assert a.tools.tools == [WEATHER] and a.tools.parallel is False and a.tools.on
    assert not ask(tools=[WEATHER], tool_choice="none").tools.on
    assert not ask(tools=[]).tools.on
    turn = ask(
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a": [1]}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}]},
        ]
    )
    assert turn.messages[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "f", "arguments": {"a": [1]}},
                    "id": "call_1",
                }
            ],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            },
            "tool_choice",
        ),
        ({"tools": [WEATHER] * 129}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]},
            "tools[0].function.examples",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]},
            "messages[0].tool_call_id",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "hi", "tool_calls": [{"type": "function"}]}
                ]
            },
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_bad_tool_fields_are_named(body, param):
    with pytest.raises(APIError) as e:
        ask(**body)
    assert (e.value.status, e.value.param) == (400, param)
    assert "\n" not in e.value.message


THINKING = "<think>I could call <tool_call>{}</tool_call> here</think>Done."


@pytest.mark.parametrize("size", [1, 2, 5, len(THINKING)])
def test_reasoning_comes_apart_and_a_call_inside_it_is_not_a_call(size):
    c = Choice(0, reader(json_tools), ThinkReader("<think>", "</think>"))
    parts = [c.read(THINKING[i : i + size]) for i in range(0, len(THINKING), size)]
    parts.append(c.close())
    assert "".join(p.reasoning for p in parts) == "I could call <tool_call>{}</tool_call> here"
    assert "".join(p.text for p in parts) == "Done."
    assert c.calls == [] and c.reader.unread == []


def test_an_answer_cut_while_thinking_keeps_its_reasoning():
    c = Choice(0, None, ThinkReader("<think>", "</think>", inside=True))
    assert c.read("still thinking </thi").reasoning == "still thinking "
    assert (c.close().reasoning, "".join(c.text)) == ("</thi", "")
