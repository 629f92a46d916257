"""Ollama's API on ``mlxkv serve`` (``/api/chat``, ``/api/generate``, ``/api/tags``, ...), as
Open WebUI, editor plugins and scripts meet it: real server processes, driven by the
official ``ollama`` client (and raw HTTP for the stream's lines and what the client would
refuse to send).

Two models: the offline default one (answers checked token for token against mlx-lm and
against the server's own OpenAI endpoints), and the scripted model of
tests/test_serve_tools.py, which thinks and then calls a tool."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.json_schemas import CITY
from tests.serve_helpers import COUNTING, Server, serving, stop_during
from tests.test_serve_tools import ASK, MARKERS, SCRIPT, TEMPLATE, THOUGHT, WEATHER, rendered
from tests.tiny_models import scripted_model

ollama = pytest.importorskip("ollama")

pytestmark = pytest.mark.model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(server: Server):
    return ollama.Client(host=server.url, timeout=600)


def whole(server: Server, path: str, body: dict) -> dict:
    """An answer as Ollama's JSON, with the ``mlxkv`` figures its client's objects drop."""
    r = server.http("POST", path, json={**body, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()


def lines(server: Server, path: str, body: dict) -> list[dict]:
    """A streamed answer's lines of JSON."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=600) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in r.iter_lines() if line]


# -- the default model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("serve-ollama"), "--shutdown-timeout", "2")


def test_a_chat_is_mlx_lms_greedy_answer(server, default_model):
    """The whole answer, its stream and a chat completion of the same conversation are
    mlx-lm's greedy tokens; the counts and timings are the engine's."""
    from mlxkv.engine.request import encode_prompt
    from tests.mlx_lm_ref import greedy_tokens

    tok = default_model.tokenizer
    chat = [{"role": "system", "content": "Answer in one sentence."}, *QUESTION]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = encode_prompt(tok, text)
    ref = greedy_tokens(default_model, ids, 40, [], tok.eos_token_ids)
    ref = ref[: ref.index(next(t for t in ref if t in tok.eos_token_ids))]

    c = client(server)
    opts = {"temperature": 0, "num_predict": 40}
    r = c.chat(model="smollm2-135m", messages=chat, options=opts)
    assert r.message.content == tok.decode(ref)
    assert (r.message.role, r.done, r.done_reason, r.model) == (
        "assistant",
        True,
        "stop",
        "smollm2-135m",
    )
    assert r.prompt_eval_count == len(ids)  # nothing cached yet: all of it read
    assert r.eval_count == len(ref) + 1  # and the EOS
    assert r.eval_duration > 0 and r.total_duration >= r.eval_duration + r.prompt_eval_duration
    pieces = list(c.chat(model="smollm2-135m:latest", messages=chat, options=opts, stream=True))
    assert "".join(p.message.content for p in pieces) == r.message.content
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert pieces[-1].done_reason == "stop" and pieces[-1].eval_count == r.eval_count

    again = whole(server, "/api/chat", {"model": "smollm2-135m", "messages": chat, "options": opts})
    kv = again["mlxkv"]
    assert kv["kv_bytes_actual"] == kv["kv_bytes_predicted"] > 0
    assert kv["prompt_tokens"] == len(ids) and kv["prompt_tokens_cached"] > 0
    assert again["prompt_eval_count"] == len(ids)  # the whole prompt, as Ollama counts it

    openai = server.client().chat.completions.create(
        model="smollm2-135m", messages=chat, max_tokens=40, temperature=0
    )
    assert openai.choices[0].message.content == r.message.content


def test_stop_strings_past_openais_count_end_the_answer(server):
    """Editors send many stop strings for code completion; Ollama takes any count."""
    stops = [f"never{i}" for i in range(30)] + [" Paris"]
    r = whole(
        server,
        "/api/chat",
        {"model": "smollm2-135m", "messages": QUESTION, "options": {"stop": stops}},
    )
    assert (r["message"]["content"], r["done_reason"]) == ("The capital of France is", "stop")


def test_a_stream_is_lines_of_json_and_stops_at_num_predict(server):
    """Ollama streams unless told not to: a line per token, the last with done_reason
    length when num_predict cut the answer."""
    got = lines(
        server,
        "/api/chat",
        {"model": "smollm2-135m", "messages": QUESTION, "options": {"num_predict": 6}},
    )
    assert "".join(g["message"]["content"] for g in got) == "The capital of France is Paris"
    assert [g["done"] for g in got] == [False] * 6 + [True]
    assert (got[-1]["done_reason"], got[-1]["eval_count"]) == ("length", 6)
    assert all(g["message"]["role"] == "assistant" for g in got)


def test_generate_raw_continues_the_text_and_templated_answers_as_chat(server):
    c = client(server)
    raw = c.generate(model="smollm2-135m", prompt=COUNTING, raw=True, options={"num_predict": 8})
    completion = server.client().completions.create(
        model="smollm2-135m", prompt=COUNTING, max_tokens=8, temperature=0
    )
    assert raw.response == completion.choices[0].text and raw.done_reason == "length"

    templated = c.generate(
        model="smollm2-135m",
        prompt=QUESTION[0]["content"],
        system="Answer in one sentence.",
        options={"num_predict": 40},
    )
    chat = c.chat(
        model="smollm2-135m",
        messages=[{"role": "system", "content": "Answer in one sentence."}, *QUESTION],
        options={"num_predict": 40},
    )
    assert templated.response == chat.message.content

    loading = c.generate(model="smollm2-135m")  # no prompt: a client loading the model
    assert (loading.done, loading.done_reason, loading.response) == (True, "load", "")


def test_the_model_is_listed_shown_and_running(server, default_model):
    c = client(server)
    listed = c.list().models
    assert [m.model for m in listed] == ["smollm2-135m"]
    d = listed[0].details
    assert (d.format, d.family, d.parameter_size, d.quantization_level) == (
        "mlx",
        "llama",
        "135M",
        "F32",
    )
    assert listed[0].size == default_model.weights_bytes
    shown = c.show("smollm2-135m")
    assert shown.capabilities == ["completion"]
    assert shown.modelinfo["llama.context_length"] == 8192
    assert shown.modelinfo["general.parameter_count"] == 134515008
    assert shown.template == default_model.tokenizer.chat_template
    running = c.ps().models
    assert [(m.model, m.context_length, m.size_vram) for m in running] == [
        ("smollm2-135m", 8192, default_model.weights_bytes)
    ]
    assert shown.modelinfo["general.basename"] == "smollm2-135m"  # the name clients show
    # the Ollama release whose API this matches: clients refuse a server older than theirs
    assert server.http("GET", "/api/version").json() == {"version": "0.12.11"}
    probe = httpx.head(f"{server.url}/", timeout=60)  # no key needed, as /health
    assert (probe.status_code, httpx.get(f"{server.url}/").text) == (200, "mlxkv is running")


def test_format_holds_the_answer_to_a_schema(server):
    c = client(server)
    r = c.chat(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Name a city in Italy as JSON with its country."}],
        format=CITY,
        options={"num_predict": 60},
    )
    answer = json.loads(r.message.content)
    assert set(answer) == {"city", "country"}
    assert answer["country"] in ("France", "Germany", "Italy")
    r = c.generate(model="smollm2-135m", prompt="A JSON object about Paris.", format="json")
    assert isinstance(json.loads(r.response), dict)


def test_num_ctx_bounds_the_kv_cache_as_a_window(server):
    """num_ctx shorter than the model's context runs the answer under sinks (num_keep,
    4 by default) and a window, num_ctx tokens in all: the KV cache stays that size."""
    body = {"model": "smollm2-135m", "messages": QUESTION, "stream": False}
    r = server.http("POST", "/api/chat", json={**body, "options": {"num_ctx": 64}}).json()
    assert r["mlxkv"]["policy"] == "sink 4 + window 60"
    r = server.http(
        "POST", "/api/chat", json={**body, "options": {"num_ctx": 48, "num_keep": 8}}
    ).json()
    assert r["mlxkv"]["policy"] == "sink 8 + window 40"
    r = server.http("POST", "/api/chat", json={**body, "options": {"num_ctx": 8192}}).json()
    assert r["mlxkv"]["policy"] == "full"


def test_logprobs_come_with_each_token(server):
    c = client(server)
    r = c.chat(
        model="smollm2-135m",
        messages=QUESTION,
        options={"num_predict": 6},
        logprobs=True,
        top_logprobs=2,
    )
    assert "".join(lp.token for lp in r.logprobs) == r.message.content
    assert all(len(lp.top_logprobs) == 2 for lp in r.logprobs)
    chat = server.client().chat.completions.create(
        model="smollm2-135m",
        messages=QUESTION,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    want = [(e.token, e.logprob) for e in chat.choices[0].logprobs.content]
    assert [(lp.token, lp.logprob) for lp in r.logprobs] == pytest.approx(want, abs=1e-4)


BAD = [
    ({"model": "llama3.2"}, 404, None),
    ({"frobnicate": 1}, 400, "frobnicate is not a field of this request; see Ollama's API"),
    (
        {"options": {"mirostat": 2}},
        400,
        "options.mirostat: this sampler is not supported; send 0 (off)",
    ),
    (
        {"options": {"mirostat_tau": "high"}},
        400,
        'options.mirostat_tau must be a number, got "high"',
    ),
    (
        {"options": {"frob": 1}},
        400,
        "options.frob is not an option of this server; see docs/serve.md",
    ),
    (
        {"options": {"repeat_last_n": -5, "repeat_penalty": 1.1}},
        400,
        "options.repeat_last_n must be in [-1, 1048576], got -5; 0 turns the penalty off, -1 "
        "looks over the whole context",
    ),
    (
        {"options": {"temperature": 3}},
        400,
        "options.temperature must be in [0, 2], got 3; 0 means greedy",
    ),
    (
        {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
        400,
        "messages[0].images: images are not supported: the model reads text",
    ),
    ({"format": "yaml"}, 400, 'format must be "json" or a JSON Schema object, got "yaml"'),
    ({"options": {"stop": ["x"] * 65}}, 400, "options.stop holds 65 strings; at most 64"),
    (
        {"options": {"stop": [""]}},
        400,
        "options.stop must be a string or a list of non-empty strings",
    ),
    ({"think": "max"}, 400, 'think must be true, false, or one of low, medium, high, got "max"'),
    (
        {"messages": [], "keep_alive": 0},
        400,
        "keep_alive 0 asks to unload the model; this server keeps the one model it started "
        "with loaded: stop mlxkv serve to free its memory",
    ),
    (
        {"options": {"num_ctx": 6}},
        400,
        "options.num_ctx 6 with num_keep 4: --max-kv-size 6 with 4 sink tokens leaves a window "
        "of 2, which must be larger than the sinks; give --max-kv-size 9 or more, or fewer "
        "--kv-sinks",
    ),
]


@pytest.mark.parametrize("extra,status,message", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_requests_get_ollamas_error_shape(server, extra, status, message):
    body = {"model": "smollm2-135m", "messages": QUESTION, "stream": False, **extra}
    r = server.http("POST", "/api/chat", json=body)
    assert r.status_code == status
    assert list(r.json()) == ["error"]
    if message is not None:
        assert r.json()["error"] == message


# -1 (the whole context) maps to the model's context length: CI runs the window of 64
@pytest.mark.parametrize("window", [64, pytest.param(-1, marks=pytest.mark.slow)])
def test_repeat_last_n_is_the_window_of_the_repetition_penalty(server, default_model, window):
    """repeat_penalty over the last repeat_last_n tokens (-1: the whole context): mlx-lm's
    greedy tokens with its repetition penalty over that window (it was a 400)."""
    from mlx_lm.sample_utils import make_logits_processors

    from mlxkv.engine.request import encode_prompt
    from tests.mlx_lm_ref import greedy_tokens

    tok = default_model.tokenizer
    chat = [{"role": "user", "content": "List the days of the week, twice, then count to 20."}]
    ids = encode_prompt(
        tok, tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    size = 8192 if window < 0 else window  # the model's context
    penalty = make_logits_processors(repetition_penalty=1.3, repetition_context_size=size)
    ref = greedy_tokens(default_model, ids, 12, penalty, tok.eos_token_ids)
    ref = [
        t for t in ref[: next((i for i, t in enumerate(ref) if t in tok.eos_token_ids), len(ref))]
    ]
    opts = {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.3, "repeat_last_n": window}
    r = whole(server, "/api/chat", {"model": "smollm2-135m", "messages": chat, "options": opts})
    assert r["message"]["content"] == tok.decode(ref)
    short = make_logits_processors(repetition_penalty=1.3, repetition_context_size=20)
    assert greedy_tokens(default_model, ids, 12, short, tok.eos_token_ids)[: len(ref)] != ref


def test_ollamas_own_defaults_are_taken(server):
    """A client that sends every option at Ollama's default (a random seed, -1; a repeat
    window of 64 with no repeat penalty; mirostat's knobs, with mirostat off) gets the
    answer of one that sends none."""
    plain = {"model": "smollm2-135m", "messages": QUESTION, "stream": False}
    plain["options"] = {"temperature": 0, "num_predict": 6}
    defaults = {**plain["options"], "seed": -1, "repeat_last_n": 64, "repeat_penalty": 1}
    defaults |= {"mirostat": 0, "mirostat_eta": 0.1, "mirostat_tau": 5.0}
    a = server.http("POST", "/api/chat", json=plain).json()
    b = server.http("POST", "/api/chat", json={**plain, "options": defaults}).json()
    assert b["message"]["content"] == a["message"]["content"] != ""


def test_the_client_raises_the_errors(server):
    c = client(server)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="llama3.2", messages=QUESTION)
    assert e.value.status_code == 404
    assert e.value.error.startswith("The model 'llama3.2' does not exist on this server")
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("llama3.2")
    assert e.value.status_code == 404
    assert "this server runs the one model it started with" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model="smollm2-135m", prompt="hi", suffix="bye")
    assert e.value.error.startswith(
        "suffix: the model 'smollm2-135m' has no fill-in-the-middle tokens"
    )


def test_a_stream_cut_by_shutdown_ends_with_an_error_line(server):
    """The last test of the default model's server: it stops it. A stream still running
    when the grace time ends gets an error line, which the ollama client raises, and the
    server exits 0."""
    started = threading.Event()
    seen: list = []
    raised: list[Exception] = []

    def read() -> None:
        messages = [{"role": "user", "content": "Count to ten thousand, one by one."}]
        try:
            for part in client(server).chat(
                model="smollm2-135m", messages=messages, stream=True, options={"num_predict": 4000}
            ):
                seen.append(part)
                started.set()
        except ollama.ResponseError as e:
            raised.append(e)

    stop_during(server, read, started)
    assert len(raised) == 1 and seen and not seen[-1].done
    assert raised[0].error.startswith("the server is shutting down; this answer was cut")


# -- a model that thinks and calls a tool --------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory, default_model_path):
    out = tmp_path_factory.mktemp("tool_model_ollama")
    return out, scripted_model(out, default_model_path, SCRIPT, TEMPLATE, MARKERS)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, built):
    yield from serving(tmp_path_factory.mktemp("serve_ollama_tools"), str(built[0]), "--force")


def test_thinking_and_a_tool_call_come_apart_from_the_answer(tool_server, built):
    folder, script = built
    c = client(tool_server)
    kw = {"model": tool_server.model, "messages": ASK, "tools": [WEATHER]}
    r = c.chat(**kw, options={"num_predict": 64})
    assert (r.message.thinking, r.message.content) == (THOUGHT, "Checking.")
    [call] = r.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Paris"})
    assert r.done_reason == "stop" and r.eval_count == len(script) + 1
    assert r.prompt_eval_count == len(rendered(folder, ASK))
    assert c.show(tool_server.model).capabilities == ["completion", "tools", "thinking"]

    got = list(c.chat(**kw, stream=True))
    assert "".join(g.message.thinking or "" for g in got) == THOUGHT
    calls = [tc for g in got for tc in g.message.tool_calls or ()]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [
        ("get_weather", {"city": "Paris"})
    ]

    # the next turn: the call and its result as Ollama's messages, rendered as the template does
    turn = [
        *ASK,
        {
            "role": "assistant",
            "content": "Checking.",
            "thinking": THOUGHT,
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"sky": "clear"}', "tool_name": "get_weather"},
    ]
    second = whole(
        tool_server, "/api/chat", {"model": tool_server.model, "messages": turn, "tools": [WEATHER]}
    )
    expected = [
        *ASK,
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": THOUGHT,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"sky": "clear"}', "name": "get_weather"},
    ]
    assert second["mlxkv"]["prompt_tokens"] == len(rendered(folder, expected))
    # newer clients name the call a tool message answers (tool_call_id), as OpenAI's do
    turn[-1]["tool_call_id"] = expected[-1]["tool_call_id"] = "call_1"
    third = whole(
        tool_server, "/api/chat", {"model": tool_server.model, "messages": turn, "tools": [WEATHER]}
    )
    assert third["mlxkv"]["prompt_tokens"] == len(rendered(folder, expected))


def test_think_false_reaches_the_template(tool_server, built):
    folder, _ = built
    body = {"model": tool_server.model, "messages": ASK, "think": False}
    r = whole(tool_server, "/api/chat", {**body, "options": {"num_predict": 4}})
    want = rendered(folder, ASK, tools=(), enable_thinking=False)
    assert r["mlxkv"]["prompt_tokens"] == len(want)
