"""Tool calling through ``mlxkv serve``, as an agent meets it: a real server process running
a model that writes a real tool call (the scripted model of tests/tiny_models.py, with a
Qwen-style chat template and tokenizer markers), driven by the official ``openai`` client."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from transformers import AutoTokenizer

from tests.serve_helpers import Server
from tests.tiny_models import scripted_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

# A Qwen-shaped template: tools listed in the system turn, calls written between
# <tool_call> markers, results sent back in a user turn (mlx-lm reads its parser from it);
# the model thinks between <think> markers first, or the prompt opens the block itself
# (chat_template_kwargs open_think, as DeepSeek-R1's template does); it reads
# reasoning_effort (as gpt-oss's does) and enable_thinking (as Qwen3's does).
TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": <function-name>, "arguments": <args>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}
{% endif %}{% if enable_thinking is defined and not enable_thinking %}<think></think>\
{% elif open_think %}<think>{% endif %}{% endif %}"""
MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
CALL = '{"name": "get_weather","arguments": {"city":"Paris"} }'
THOUGHT = "The user wants the weather"
ANSWER = f"Checking.<tool_call>{CALL}</tool_call>"
SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def rendered(folder, messages: list[dict], tools=(WEATHER,), **kwargs) -> list[int]:
    """The prompt's token ids as the model's own tokenizer renders it (with the tools)."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template(
        messages, tools=list(tools) or None, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory, default_model_path):
    out = tmp_path_factory.mktemp("tool_model")
    return out, scripted_model(out, default_model_path, SCRIPT, TEMPLATE, MARKERS)


@pytest.fixture(scope="module")
def folder(built):
    return built[0]


@pytest.fixture(scope="module")
def script_ids(built):
    return built[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    s = Server(tmp_path_factory.mktemp("serve_tools"), str(folder), "--force")
    s.model = s.http("GET", "/v1/models").json()["data"][0]["id"]
    yield s
    code = s.stop()
    assert code == 0, s.log()
    assert "Traceback" not in s.log(), s.log()


def test_the_scripted_model_writes_its_script(server):
    """Without tools, the call is the model's text: nothing is parsed; its thinking comes
    apart, as reasoning_content."""
    r = server.client().chat.completions.create(model=server.model, messages=ASK, temperature=0)
    assert r.choices[0].message.content == ANSWER
    assert r.choices[0].message.model_extra["reasoning_content"] == THOUGHT
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_a_prompt_that_opens_the_think_block(server, script_ids):
    """The answer starts inside the block when the prompt opened it: what comes before
    </think> is reasoning."""
    r = server.client().chat.completions.create(
        model=server.model,
        messages=ASK,
        temperature=0,
        extra_body={"chat_template_kwargs": {"open_think": True}},
    )
    assert r.choices[0].message.content == ANSWER
    assert r.choices[0].message.model_extra["reasoning_content"] == THOUGHT
    assert r.usage.completion_tokens == len(script_ids)  # <think> was the prompt's; + EOS


@pytest.mark.parametrize("budget", [0, 2])
@pytest.mark.parametrize("open_think", [False, True])
def test_a_thinking_budget_closes_the_think_block(server, folder, script_ids, budget, open_think):
    """thinking_budget: after that many reasoning tokens the think block is closed for the
    model (its end marker forced), which goes on to its answer; whether the model opened
    the block or the prompt did."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    end = script_ids.index(tok.convert_tokens_to_ids("</think>"))
    thought = script_ids[1:end]  # between <think> and </think>
    assert len(thought) > budget
    r = server.client().chat.completions.create(
        model=server.model,
        messages=ASK,
        temperature=1,  # the forced marker holds whatever the sampler would pick
        seed=5,
        extra_body={"thinking_budget": budget, "chat_template_kwargs": {"open_think": open_think}},
    )
    message = r.choices[0].message
    assert message.model_extra.get("reasoning_content", "") == tok.decode(thought[:budget])
    assert message.content == ANSWER
    cut = len(thought) - budget
    assert r.usage.completion_tokens == len(script_ids) + 1 - cut - open_think


def test_the_servers_thinking_budget_is_the_default_of_requests(tmp_path, folder, script_ids):
    """serve --thinking-budget: requests that do not set one are cut at it; a request's own
    thinking_budget (or Anthropic's budget_tokens) wins."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    flags = (str(folder), "--force", "--thinking-budget", "1", "--shutdown-timeout", "2")
    server = Server(tmp_path, *flags)
    try:
        model = server.http("GET", "/v1/models").json()["data"][0]["id"]
        c = server.client()
        cut = c.chat.completions.create(model=model, messages=ASK)
        assert cut.choices[0].message.model_extra["reasoning_content"] == tok.decode(
            script_ids[1:2]
        )
        whole = c.chat.completions.create(
            model=model, messages=ASK, extra_body={"thinking_budget": 100}
        )
        assert whole.choices[0].message.model_extra["reasoning_content"] == THOUGHT
        body = {"model": model, "max_tokens": 2048, "messages": ASK}
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
        blocks = server.http("POST", "/v1/messages", json=body).json()["content"]
        assert blocks[0] == {"type": "thinking", "thinking": THOUGHT, "signature": ""}
    finally:
        assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()


def test_generate_takes_a_thinking_budget(folder, script_ids):
    """The same budget on the command line: mlxkv generate prints the cut reasoning, then
    the whole answer."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    end = script_ids.index(tok.convert_tokens_to_ids("</think>"))
    run = subprocess.run(
        [sys.executable, "-m", "mlxkv", "generate", "--model", str(folder), "--force"]
        + ["--prompt", ASK[0]["content"], "--thinking-budget", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"<think>{tok.decode(script_ids[1:2])}</think>{ANSWER}"
    assert end > 2  # the script thinks for more than one token


@pytest.mark.parametrize("temperature", [0, 1])
def test_a_tool_call_comes_back_as_tool_calls(server, temperature):
    r = server.client().chat.completions.create(
        model=server.model, messages=ASK, tools=[WEATHER], temperature=temperature, n=2, seed=3
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        assert choice.message.model_extra["reasoning_content"] == THOUGHT
        (call,) = choice.message.tool_calls
        assert call.type == "function"
        assert call.id.startswith("call_") and len(call.id) == 29
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id


def test_a_strict_tool_the_model_chooses_to_call(server):
    """OpenAI's pydantic_function_tool and Agents SDK send strict: true on every tool (it
    was a 400); a call the model chooses to make that keeps to the schema comes back as
    the model wrote it, held but untouched."""
    import openai
    import pydantic

    class GetWeather(pydantic.BaseModel):
        city: str

    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    assert tool["function"]["strict"] is True
    r = server.client().chat.completions.create(model=server.model, messages=ASK, tools=[tool])
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_tool_call(server, script_ids):
    stream = server.client().chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, thought, calls, reasons, usage = [], [], [], [], None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        d = chunk.choices[0]
        content.append(d.delta.content or "")
        thought.append(d.delta.model_extra.get("reasoning_content") or "")
        calls += d.delta.tool_calls or []
        reasons.append(d.finish_reason)
    assert "".join(content) == "Checking."
    assert "".join(thought) == THOUGHT
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert [r for r in reasons if r] == ["tool_calls"]
    assert usage.completion_tokens == len(script_ids) + 1  # the script and its EOS


def test_tool_choice_none_leaves_the_tools_out(server, folder):
    """With tool_choice "none" the prompt is rendered without the tools (as without
    them) and the answer is text."""
    client = server.client()
    plain = client.chat.completions.create(model=server.model, messages=ASK, temperature=0)
    none = client.chat.completions.create(
        model=server.model, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0
    )
    offered = client.chat.completions.create(
        model=server.model, messages=ASK, tools=[WEATHER], temperature=0
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == ANSWER
    assert offered.usage.prompt_tokens == len(rendered(folder, ASK))


@pytest.mark.parametrize(
    "effort, extra, template_kwargs",
    [
        ("high", {}, {"reasoning_effort": "high"}),
        ("none", {}, {"reasoning_effort": "none", "enable_thinking": False}),
        ("none", {"enable_thinking": True}, {"reasoning_effort": "none"}),  # theirs wins
    ],
)
def test_reasoning_effort_reaches_the_chat_template(server, folder, effort, extra, template_kwargs):
    """reasoning_effort is handed to the template as itself, and "none" as
    enable_thinking: false; chat_template_kwargs sent beside it win."""
    r = server.client().chat.completions.create(
        model=server.model,
        messages=ASK,
        max_tokens=1,
        reasoning_effort=effort,
        extra_body={"chat_template_kwargs": extra} if extra else None,
    )
    want = rendered(folder, ASK, tools=(), **template_kwargs)
    assert r.usage.prompt_tokens == len(want) != len(rendered(folder, ASK, tools=()))


def test_the_sdk_sends_the_answer_back_whole(server):
    """The openai SDK's tool loop appends the answer's message object as it came, with its
    reasoning_content (pydantic-ai and litellm do too): the next turn takes it (a 400)."""
    client = server.client()
    first = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER])
    message = first.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT
    turn = [
        *ASK,
        message,
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21 C"},
    ]
    second = client.chat.completions.create(model=server.model, messages=turn, tools=[WEATHER])
    assert second.choices[0].message.tool_calls[0].function.name == "get_weather"
    alias = {"role": "assistant", "content": "Checking.", "reasoning": THOUGHT}
    third = client.chat.completions.create(
        model=server.model, messages=[*ASK, alias, *ASK], max_tokens=2
    )
    assert third.usage.completion_tokens == 2


def test_the_tool_result_turn(server, folder):
    """The agent's next turn: the assistant's call and the tool's result go back through
    the chat template exactly as it renders them, and the prefix cache serves the turn
    before."""
    client = server.client()
    first = client.chat.completions.create(
        model=server.model, messages=ASK, tools=[WEATHER], temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    turn = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "c": 21}'},
    ]
    second = client.chat.completions.create(model=server.model, messages=turn, tools=[WEATHER])
    expected = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "c": 21}'},
    ]
    assert second.usage.prompt_tokens == len(rendered(folder, expected))
    # the first turn's prompt is a prefix of this one: the prefix cache serves all of it
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert second.choices[0].finish_reason == "tool_calls"


# tools whose arguments cannot run on: a forced call of the scripted model (which knows
# only its script) ends as the schema does
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.parametrize(
    "choice, name, arguments",
    [
        ("required", "get_weather", {"city": "Paris"}),
        ({"type": "function", "function": {"name": "get_time"}}, "get_time", {}),
    ],
    ids=["required", "named"],
)
def test_a_forced_call_comes_whole_and_stream(server, choice, name, arguments):
    """tool_choice "required" or a named function holds the answer to a list of calls of
    the tools (of that one): it comes back as tool_calls, whole or streamed."""
    kw = {"model": server.model, "messages": ASK, "tools": [CITY, CLOCK], "tool_choice": choice}
    kw.update(parallel_tool_calls=False, max_tokens=64, temperature=0)
    r = server.client().chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == name and json.loads(call.function.arguments) == arguments
    assert c.message.model_extra.get("reasoning_content") is None
    calls, texts = [], []
    for chunk in server.client().chat.completions.create(stream=True, **kw):
        calls += chunk.choices[0].delta.tool_calls or []
        texts.append(chunk.choices[0].delta.content or "")
    (streamed,) = calls
    assert streamed.function.name == name and json.loads(streamed.function.arguments) == arguments
    assert "".join(texts) == ""


def test_a_forced_call_with_an_answer_format_is_the_call(server):
    """instructor's Responses mode sends a forced call and a text.format naming the same
    schema (it was a 400): the call wins, as it does beside response_format; the format
    is that of a text answer, and there is none."""
    params = CITY["function"]["parameters"]
    body = {
        "input": ASK,
        "tools": [{"type": "function", "name": "get_weather", "parameters": params}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "City", "schema": params}},
        "max_output_tokens": 64,
        "temperature": 0,
    }
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    (call,) = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    kw = {"model": server.model, "messages": ASK, "tools": [CITY], "tool_choice": "required"}
    r = server.client().chat.completions.create(
        **kw, response_format={"type": "json_object"}, parallel_tool_calls=False
    )
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}


BAD = [
    (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools[0].function.name",
        "tools[0].function.name must be 1 to 64 letters, digits, '_' or '-', got \"get weather\"",
    ),
    (
        {"tools": [WEATHER, WEATHER]},
        "tools[1].function.name",
        "tools[1].function: the name 'get_weather' is given twice",
    ),
    (
        {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
        "tools[0].type",
        "tools[0] must be a function tool ({type: 'function', function: {name, parameters}}); "
        "'custom' tools are not supported",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "tool_choice names 'nope', which is not among the tools",
    ),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools to call"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        "tools[0].function.strict",
        "tools[0].function.strict must be true or false",
    ),
    (
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
        "messages[1].tool_calls[0].function.arguments is not valid JSON; send the arguments "
        "the model's call gave",
    ),
    (
        {"messages": [*ASK, {"role": "tool", "content": "21 C"}]},
        "messages[1].tool_call_id",
        "messages[1].tool_call_id must be the id of the call this message answers",
    ),
    (
        {"messages": [*ASK, {"role": "assistant", "content": "x", "reasoning_content": 5}]},
        "messages[1].reasoning_content",
        "messages[1].reasoning_content must be a string",
    ),
    (
        {"reasoning_effort": "extreme"},
        "reasoning_effort",
        "reasoning_effort must be one of none, minimal, low, medium, high, xhigh, max, got "
        '"extreme"',
    ),
]


@pytest.mark.parametrize("extra,param,message", BAD, ids=[b[1] for b in BAD])
def test_bad_tool_requests_get_a_400_naming_the_field(server, extra, param, message):
    body = {"messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["message"], err["type"]) == (param, message, "invalid_request_error")


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_strict_call_the_model_chooses_is_held_to_its_schema(server, api):
    """The script's call gives "city" a string; a strict schema asks an integer. Held from
    the <tool_call> marker, the arguments the model writes are an integer (the scripted
    model, off its script, then writes no end marker: the call stays text). Not strict,
    the same call comes back as written."""
    params = {
        "type": "object",
        "properties": {"city": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fn = {"name": "get_weather", "parameters": params}

    def ask(strict: bool) -> str:
        if api == "chat":
            tool = {"type": "function", "function": {**fn, "strict": strict}}
            body = {"messages": ASK, "tools": [tool], "temperature": 0, "max_tokens": 40}
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            message = r.json()["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            return calls[0]["function"]["arguments"] if calls else message["content"]
        if api == "responses":
            tool = {"type": "function", **fn, "strict": strict}
            body = {"input": ASK, "tools": [tool], "temperature": 0, "max_output_tokens": 40}
            r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
            items = r.json()["output"]
            calls = [i for i in items if i["type"] == "function_call"]
            texts = [c["text"] for i in items if i["type"] == "message" for c in i["content"]]
            return calls[0]["arguments"] if calls else "".join(texts)
        tool = {"name": "get_weather", "input_schema": params, "strict": strict}
        body = {"messages": ASK, "tools": [tool], "temperature": 0, "max_tokens": 40}
        r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
        blocks = r.json()["content"]
        calls = [b for b in blocks if b["type"] == "tool_use"]
        texts = [b["text"] for b in blocks if b["type"] == "text"]
        return json.dumps(calls[0]["input"]) if calls else "".join(texts)

    held = ask(True)
    body = held.split("<tool_call>")[1].split("<|endoftext|>")[0]
    assert isinstance(json.loads(body)["arguments"]["city"], int), held
    assert json.loads(ask(False)) == {"city": "Paris"}


def test_strict_tools_left_out_by_tool_choice_none(server):
    """Responses' tools are strict unless sent false; with tool_choice "none" they are left
    out, and nothing is held (no call can come)."""
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": WEATHER["function"]["parameters"],
    }
    body = {"input": ASK, "tools": [tool], "tool_choice": "none", "max_output_tokens": 4}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert [i["type"] for i in r.json()["output"]] == ["reasoning"]  # 4 tokens of thinking


def test_strict_calls_are_held_row_by_row_in_a_batch(server):
    """n=2 decodes two rows in one batch, each with its own held call: both calls give
    "city" an integer, the same calls (greedy). The schema allows other keys, so the
    script's own "arguments" key goes on beside it."""
    params = {"type": "object", "properties": {"city": {"type": "integer"}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    tool["function"]["strict"] = True
    body = {"messages": ASK, "tools": [tool], "temperature": 0, "max_tokens": 40, "n": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    calls = [c["message"]["tool_calls"] for c in r.json()["choices"]]
    assert calls[0][0]["function"] == calls[1][0]["function"]
    assert isinstance(json.loads(calls[0][0]["function"]["arguments"])["city"], int), calls


@pytest.mark.parametrize("city", ["string", "integer"])
def test_a_held_call_takes_drafts_and_answers_as_without(folder, city):
    """A strict call's grammar (held from the <tool_call> marker) is shown drafts: the free
    text before the marker takes the conversation's guesses up to the marker, the call its
    forced tokens and the guesses its grammar allows, and the grammar forgets those the
    model did not keep. The answer is the undrafted one token for token: the script where
    it fits the schema, the model held off its script where it does not ("city" an
    integer)."""
    from mlxkv.engine.events import TokenDelta
    from mlxkv.engine.grammar import call_grammar
    from mlxkv.engine.request import GenerationSettings
    from mlxkv.engine.scheduler import Request, Scheduler
    from mlxkv.models.loader import load

    loaded = load(folder)
    params = {"type": "object", "properties": {"city": {"type": city}}, "required": ["city"]}
    call = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    settings = GenerationSettings(max_tokens=40, call_grammar=call_grammar(call))
    ids = rendered(folder, ASK)

    def answer(drafts: int):
        scheduler = Scheduler(loaded, draft_tokens=drafts)
        events = list(scheduler.submit(Request(ids, settings)).events())
        return scheduler, [e.token for e in events if isinstance(e, TokenDelta) and e.token >= 0]

    _, plain = answer(0)
    scheduler, drafted = answer(8)
    assert drafted == plain
    text = loaded.tokenizer.decode(plain)
    body = text.split("<tool_call>")[1].split("</tool_call>")[0].split("<|endoftext|>")[0]
    assert isinstance(json.loads(body)["arguments"]["city"], str if city == "string" else int)
    assert scheduler.accepted >= 5 and scheduler.drafted > scheduler.accepted  # some not kept


@pytest.mark.parametrize("budget", [1, 3])
def test_a_thinking_budget_takes_drafts_and_answers_as_without(folder, budget):
    """A thinking budget is shown drafts and forgets those the model did not keep: given
    the script as the prediction (drafts that run past the budget, where the end marker is
    forced instead), the answer is the undrafted one token for token."""
    from mlxkv.engine.events import TokenDelta
    from mlxkv.engine.request import GenerationSettings
    from mlxkv.engine.scheduler import Request, Scheduler
    from mlxkv.models.loader import load

    loaded = load(folder)
    tok = loaded.tokenizer
    settings = GenerationSettings(max_tokens=40, think_budget=budget)
    ids = rendered(folder, ASK, tools=())
    script = tok.encode(SCRIPT, add_special_tokens=False)

    def answer(drafts: int):
        scheduler = Scheduler(loaded, draft_tokens=drafts)
        events = list(scheduler.submit(Request(ids, settings, prediction=script)).events())
        return scheduler, [e.token for e in events if isinstance(e, TokenDelta) and e.token >= 0]

    _, plain = answer(0)
    scheduler, drafted = answer(8)
    assert drafted == plain
    assert tok.decode(plain).startswith("<think>") and "</think>Checking." in tok.decode(plain)
    assert scheduler.accepted >= 5 and scheduler.drafted > scheduler.accepted
