"""Anthropic's Messages API on ``mlxkv serve`` (``POST /v1/messages``), as clients built on
Anthropic's SDKs meet it: real server processes, driven by the official ``anthropic``
client (and raw HTTP for the stream's events and what the client would refuse to send).

Two models: the offline default one (answers checked token for token against mlx-lm
and against the server's own chat completions), and the scripted model of
tests/test_serve_tools.py, which thinks and then calls a tool."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve_helpers import Server, cut_by_shutdown, named_events, serving
from tests.test_serve_tools import (
    ASK,
    MARKERS,
    SCRIPT,
    TEMPLATE,
    THOUGHT,
    WEATHER,
    rendered,
)
from tests.tiny_models import scripted_model

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOL = {  # WEATHER as Anthropic's API writes a tool
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}


def client(server: Server):
    return anthropic.Anthropic(
        base_url=server.url, api_key=server.key or "none", max_retries=0, timeout=600
    )


def post(server: Server, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=600)


def events(server: Server, body: dict) -> list[tuple[str, dict]]:
    return named_events(server, "/v1/messages", body)


# -- the default model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("serve-messages"), "--shutdown-timeout", "2")


def test_an_answer_is_mlx_lms_greedy_answer(server, default_model):
    """The whole answer, its stream and a chat completion of the same conversation are
    mlx-lm's greedy tokens; the system prompt reaches the template."""
    from mlxkv.engine.request import encode_prompt
    from tests.mlx_lm_ref import greedy_tokens

    tok = default_model.tokenizer
    chat = [{"role": "system", "content": "Answer in one sentence."}, *QUESTION]
    ids = encode_prompt(
        tok, tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    ref = greedy_tokens(default_model, ids, 40, [], tok.eos_token_ids)
    ref = ref[: ref.index(next(t for t in ref if t in tok.eos_token_ids))]

    c = client(server)
    kw = {"model": "smollm2-135m", "max_tokens": 40, "system": chat[0]["content"]}
    r = c.messages.create(messages=QUESTION, **kw)
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == tok.decode(ref)
    assert (r.role, r.model, r.stop_reason, r.stop_sequence) == (
        "assistant",
        "smollm2-135m",
        "end_turn",
        None,
    )
    assert r.id.startswith("msg_")
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == len(ids)
    assert u.output_tokens == len(ref) + 1  # and the EOS
    kv = u.model_extra["mlxkv"]
    assert kv["kv_bytes_actual"] == kv["kv_bytes_predicted"] > 0

    with c.messages.stream(messages=QUESTION, **kw) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == r.content[0].text and len(pieces) > 1
    assert final.content[0].text == r.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == u.output_tokens

    openai = server.client().chat.completions.create(
        model="smollm2-135m", messages=chat, max_tokens=40, temperature=0
    )
    assert openai.choices[0].message.content == r.content[0].text


def test_the_stream_is_anthropics_event_sequence(server):
    ev = events(
        server,
        {"model": "smollm2-135m", "max_tokens": 6, "messages": QUESTION, "stream": True},
    )
    names = [n for n, _ in ev]
    assert names[:2] == ["message_start", "content_block_start"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = ev[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    assert ev[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    text = "".join(d["delta"]["text"] for n, d in ev if n == "content_block_delta")
    assert text == "The capital of France is Paris"
    delta = ev[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6


def test_a_prefill_is_continued_with_its_space_and_a_stop_sequence_named(server, default_model):
    """A last assistant message is the start of the answer (a prefill): the answer goes on
    from it, as mlx-lm's greedy tokens of the open prompt, keeping its first space; the
    stop sequence that ended it is named."""
    from tests.mlx_lm_ref import greedy_tokens

    tok = default_model.tokenizer
    chat = [
        {"role": "user", "content": "Count from 1 to 10"},
        {"role": "assistant", "content": "1, 2, 3, 4,"},
    ]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    ids = tok.apply_chat_template(chat, **kw)
    ref = tok.decode(greedy_tokens(default_model, ids, 12, []))
    assert ref.startswith(" 5, 6, 7")

    c = client(server)
    r = c.messages.create(model="smollm2-135m", max_tokens=12, messages=chat)
    assert r.content[0].text == ref[: len(r.content[0].text)] and r.content[0].text.startswith(" 5")
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(ids)

    r = c.messages.create(
        model="smollm2-135m", max_tokens=12, messages=chat, stop_sequences=["9", " 7"]
    )
    assert r.content[0].text == " 5, 6,"
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", " 7")


def test_max_tokens_0_fills_the_cache_and_count_tokens_counts(server):
    """max_tokens 0 sends no answer and leaves the prompt in the prefix cache: the next
    request on it prefills one token; count_tokens counts the rendered prompt."""
    c = client(server)
    chat = [{"role": "user", "content": "A long system of rules, warmed up before use."}]
    n = c.messages.count_tokens(model="smollm2-135m", messages=chat).input_tokens
    warm = c.messages.create(model="smollm2-135m", max_tokens=0, messages=chat)
    assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0)
    assert warm.usage.input_tokens + warm.usage.cache_read_input_tokens == n
    again = c.messages.create(model="smollm2-135m", max_tokens=1, messages=chat)
    assert (again.usage.input_tokens, again.usage.cache_read_input_tokens) == (1, n - 1)


def test_claude_codes_context_management_changes_nothing(server):
    """Claude Code asks to clear thinking while keeping all of it: the same prompt."""
    keep = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    body = {"model": "smollm2-135m", "max_tokens": 4, "messages": QUESTION}
    plain = post(server, body).json()
    kept = post(server, {**body, "context_management": keep})
    assert kept.status_code == 200, kept.text
    total = plain["usage"]["input_tokens"] + plain["usage"]["cache_read_input_tokens"]
    usage = kept.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == total
    ask = {"model": "smollm2-135m", "messages": QUESTION, "context_management": keep}
    count = post(server, ask, "/v1/messages/count_tokens")
    assert count.json() == {"input_tokens": total}


def test_the_anthropic_client_lists_the_model(server):
    page = client(server).models.list()
    assert [(m.id, m.type, m.display_name) for m in page.data] == [
        ("smollm2-135m", "model", "smollm2-135m")
    ]
    assert page.has_more is False and page.first_id == "smollm2-135m"
    assert client(server).models.retrieve("smollm2-135m").created_at.tzinfo is not None


def test_the_kv_extension(server):
    r = client(server).messages.create(
        model="smollm2-135m",
        max_tokens=4,
        messages=QUESTION,
        extra_body={"kv": {"window": 16, "sinks": 4}},
    )
    assert r.usage.model_extra["mlxkv"]["policy"] == "sink 4 + window 16"


BAD = [
    ({"max_tokens": None}, 400, "max_tokens: Field required (the most tokens to generate)"),
    ({"model": "claude-opus-4-6"}, 404, None),
    ({"frobnicate": 1}, 400, "frobnicate: Extra inputs are not permitted"),
    (
        {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
        400,
        "context_management.edits[0]: only clear_thinking with keep 'all' (no change) is "
        "supported; the model reads the messages as sent",
    ),
    ({"temperature": 1.5}, 400, "temperature must be in [0, 1], got 1.5; 0 means greedy"),
    ({"stop_sequences": ["x"] * 65}, 400, "stop_sequences takes at most 64, got 65"),
    (
        {"messages": [{"role": "system", "content": "x"}]},
        400,
        "messages[0].role must be 'user' or 'assistant', got \"system\"",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        400,
        "messages[0].content[0]: only text blocks are supported here (got 'image')",
    ),
    (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        400,
        "tools[0]: 'web_search_20250305' is a tool Anthropic's servers run; this server takes "
        "client tools only ({name, description, input_schema})",
    ),
    ({"tool_choice": {"type": "any"}}, 400, "tool_choice {type: 'any'} needs tools to call"),
    (
        {"tool_choice": {"type": "required"}},
        400,
        "tool_choice must be {type: 'auto'}, {type: 'any'}, {type: 'tool', name} or "
        '{type: \'none\'}, got {"type": "required"}',
    ),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 1024},
        400,
        "max_tokens (1024) must be greater than thinking.budget_tokens (2048)",
    ),
    (
        {"output_config": {"format": {"type": "json_object"}}},
        400,
        "output_config.format must be {type: 'json_schema', schema: {...}}",
    ),
    (
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
        400,
        "the JSON schema cannot be used: Invalid type: nonsense",
    ),
    ({"container": "c_1"}, 400, "container: containers (code execution) are not supported"),
    (
        {"messages": [{"role": "user", "content": []}]},
        400,
        "messages[0]: all messages must have non-empty content except for the optional final "
        "assistant message",
    ),
    (
        {"messages": [*QUESTION, {"role": "assistant", "content": ""}, *QUESTION]},
        400,
        "messages[1]: all messages must have non-empty content except for the optional final "
        "assistant message",
    ),
    ({"stream": "yes"}, 400, 'stream must be true or false, got "yes"'),
    (
        {"kv": {"window": 4, "sinks": 8}},
        400,
        "kv.window (4) must be larger than kv.sinks (8)",
    ),
]


@pytest.mark.parametrize("extra,status,message", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_requests_get_anthropics_error_shape(server, extra, status, message):
    body = {"model": "smollm2-135m", "max_tokens": 8, "messages": QUESTION, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = post(server, body)
    assert r.status_code == status
    err = r.json()
    assert err["type"] == "error" and set(err) == {"type", "error"}
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert err["error"]["type"] == kind
    if message is not None:
        assert err["error"]["message"] == message


def test_the_anthropic_client_raises_the_errors(server):
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-opus-4-6", max_tokens=8, messages=QUESTION)
    assert e.value.body["error"]["message"] == (
        "The model 'claude-opus-4-6' does not exist on this server: it serves 'smollm2-135m' "
        "(GET /v1/models); the model is chosen when mlxkv serve starts (--served-model-name "
        "gives it more names)"
    )
    r = httpx.get(f"{server.url}/v1/messages", timeout=60)
    assert (r.status_code, r.json()["error"]["type"]) == (405, "invalid_request_error")
    assert "Traceback" not in server.log()


def test_a_stream_cut_by_shutdown_ends_with_an_error_event(server):
    """The last test of the default model's server: it stops it. A stream still running
    when the grace time ends gets Anthropic's error event, and the server exits 0."""
    body = {"model": "smollm2-135m", "max_tokens": 4000, "stream": True}
    body["messages"] = [{"role": "user", "content": "Count to ten thousand, one by one."}]
    lines = cut_by_shutdown(server, "/v1/messages", body, "event: content_block_delta")
    assert lines[-2] == "event: error"
    err = json.loads(lines[-1][len("data: ") :])
    assert err["type"] == "error" and err["error"]["type"] == "api_error"
    assert err["error"]["message"].startswith("the server is shutting down; this answer was cut")


# -- a model that thinks and calls a tool --------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory, default_model_path):
    out = tmp_path_factory.mktemp("tool_model_messages")
    return out, scripted_model(out, default_model_path, SCRIPT, TEMPLATE, MARKERS)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, built):
    yield from serving(tmp_path_factory.mktemp("serve_messages_tools"), str(built[0]), "--force")


def test_thinking_text_and_a_tool_use_come_as_blocks(tool_server, built):
    folder, script = built
    c = client(tool_server)
    kw = {"model": tool_server.model, "max_tokens": 64, "messages": ASK, "tools": [TOOL]}
    r = c.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"]
    assert r.content[0].thinking == THOUGHT
    assert r.content[1].text == "Checking."
    use = r.content[2]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert use.id.startswith("call_")
    assert r.stop_reason == "tool_use"
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(rendered(folder, ASK))
    assert r.usage.output_tokens == len(script) + 1

    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == THOUGHT and final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"

    ev = events(tool_server, {**kw, "stream": True})
    blocks = [d["content_block"] for n, d in ev if n == "content_block_start"]
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    json_deltas = [
        d["delta"] for n, d in ev if d.get("delta", {}).get("type") == "input_json_delta"
    ]
    assert [json.loads(d["partial_json"]) for d in json_deltas] == [{"city": "Paris"}]


def test_the_tool_result_turn_renders_as_the_template_does(tool_server, built):
    """The next turn: the assistant's thinking, text and tool_use and the user's
    tool_result reach the chat template as the OpenAI-style messages it reads, and the
    prefix cache serves the turn before."""
    folder, _ = built
    c = client(tool_server)
    kw = {"model": tool_server.model, "max_tokens": 64, "tools": [TOOL]}
    first = c.messages.create(messages=ASK, **kw)
    use = first.content[2]
    turn = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": '{"sky": "clear"}'},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    second = c.messages.create(messages=turn, **kw)
    expected = [
        *ASK,
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": THOUGHT,
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": '{"sky": "clear"}'},
        {"role": "user", "content": "And tomorrow?"},
    ]
    u = second.usage
    assert u.input_tokens + u.cache_read_input_tokens == len(rendered(folder, expected))
    assert (
        u.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens
    )
    n = c.messages.count_tokens(model=tool_server.model, messages=turn, tools=[TOOL])
    assert n.input_tokens == len(rendered(folder, expected))


def test_a_forced_tool_use(tool_server):
    """tool_choice any (or one tool by name) holds the answer to a call: a tool_use block
    whose input matches the tool's schema."""
    city = {
        "name": "get_weather",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    c = client(tool_server)
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        r = c.messages.create(
            model=tool_server.model,
            max_tokens=64,
            messages=ASK,
            tools=[city],
            tool_choice={**choice, "disable_parallel_tool_use": True},
        )
        assert [b.type for b in r.content] == ["tool_use"]
        assert (r.content[0].name, r.content[0].input) == ("get_weather", {"city": "Paris"})
        assert r.stop_reason == "tool_use"


def test_thinking_switches_and_display(tool_server, built):
    """thinking "disabled" reaches the template as enable_thinking false; display
    "omitted" keeps the thinking block without its text; tool_choice none leaves the
    tools out, so the call is text."""
    folder, _ = built
    c = client(tool_server)
    kw = {"model": tool_server.model, "max_tokens": 64, "messages": ASK}
    off = c.messages.create(thinking={"type": "disabled"}, **kw)
    want = rendered(folder, ASK, tools=(), enable_thinking=False)
    assert off.usage.input_tokens + off.usage.cache_read_input_tokens == len(want)

    hidden = c.messages.create(
        thinking={"type": "adaptive", "display": "omitted"}, tools=[TOOL], **kw
    )
    assert [b.type for b in hidden.content] == ["thinking", "text", "tool_use"]
    assert hidden.content[0].thinking == ""

    none = c.messages.create(tools=[TOOL], tool_choice={"type": "none"}, **kw)
    assert [b.type for b in none.content] == ["thinking", "text"]
    assert none.content[1].text.startswith("Checking.<tool_call>")
    assert none.stop_reason == "end_turn"
