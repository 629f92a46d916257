"""``mlxkv serve`` as a client meets it: a real server process on 127.0.0.1 with the
offline default model, driven by the official ``openai`` client (and raw HTTP for what a
client library would refuse to send)."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import threading

import httpx
import pytest

from tests.conftest import preload
from tests.json_schemas import CITY
from tests.serve_helpers import COUNTING, ROOT, Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model
QUESTION = "What is the capital of France?"
POLICIES = {  # per-request "kv" extension -> the same policy as mlxkv generate flags
    "full": ({}, []),
    "sink+window": ({"window": 16, "sinks": 4}, ["--kv-window", "16", "--kv-sinks", "4"]),
    "4-bit": ({"bits": 4}, ["--kv-bits", "4"]),
}
MAX_TOKENS = 20


def generate_reference(flags: list[str]) -> dict:
    """``mlxkv generate --json`` for QUESTION under ``flags``, in this process (the model
    opened is whatever the caller preloaded)."""
    from mlxkv.cli import main

    argv = ["generate", "-p", QUESTION, "--json", "--max-tokens", str(MAX_TOKENS), *flags]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"))
    yield s
    code = s.stop()
    assert code == 0, s.log()
    assert "Traceback" not in s.log(), s.log()


@pytest.fixture(scope="module")
def references(server, default_model):
    """``mlxkv generate`` for each policy, on the loaded default model in this process."""
    with pytest.MonkeyPatch.context() as mp:
        preload(mp, default_model)
        return {name: generate_reference(flags) for name, (_, flags) in POLICIES.items()}


def chat(client, kv: dict, **kw):
    return client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=kw.pop("max_tokens", MAX_TOKENS),
        temperature=0,
        extra_body={"kv": kv} if kv else None,
        **kw,
    )


@pytest.mark.parametrize("policy", list(POLICIES))
def test_chat_answers_as_generate_does(server, references, policy):
    kv, _ = POLICIES[policy]
    ref = references[policy]
    client = server.client()

    whole = chat(client, kv)
    assert whole.choices[0].message.content == ref["text"]
    assert whole.choices[0].finish_reason == (
        "stop" if ref["finish_reason"] == "stop" else "length"
    )
    assert whole.model == "smollm2-135m"
    assert whole.usage.prompt_tokens == ref["prompt_tokens"]
    assert whole.usage.completion_tokens == ref["generation_tokens"]
    kvu = whole.usage.model_extra["mlxkv"]
    assert kvu["kv_bytes_actual"] == kvu["kv_bytes_predicted"] > 0
    assert (
        kvu["policy"]
        == {
            "full": "full",
            "sink+window": "sink 4 + window 16",
            "4-bit": "full, 4-bit (group 64), kivi keys",
        }[policy]
    )

    stream = chat(client, kv, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        whole.choices[0].finish_reason
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_is_server_sent_events_ending_in_done(server):
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    r = server.http("POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage


def test_text_completion_stream_and_logprobs(server):
    client = server.client()
    done = client.completions.create(
        model="smollm2-135m", prompt=COUNTING, max_tokens=6, temperature=0, logprobs=2
    )
    c = done.choices[0]
    assert c.text == " 10, 1"  # what the tokens add to the prompt: "9," + " 10, 1"
    assert c.finish_reason == "length"
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text  # each token's own text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == logprob == top[token] <= 0  # greedy
    parts = list(
        client.completions.create(
            model="smollm2-135m", prompt=COUNTING, max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in parts) == c.text


def test_chat_logprobs_stop_and_n(server, references):
    client = server.client()
    r = chat(client, {}, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert all(e.top_logprobs[0].token == e.token and len(e.top_logprobs) == 3 for e in content)
    assert all(bytes(e.bytes) == e.token.encode() for e in content)

    # the prompt-caching hints agents send (OpenAI's names) are taken, and change nothing
    hinted = chat(client, {}, prompt_cache_key="agent-7", prompt_cache_retention="24h")
    assert hinted.choices[0].message.content == references["full"]["text"]

    cut = chat(client, {}, stop=["Paris"])
    assert cut.choices[0].message.content == references["full"]["text"].split("Paris")[0]
    assert cut.choices[0].finish_reason == "stop"

    two = chat(client, {}, n=2, max_tokens=None, max_completion_tokens=5)  # null: not given
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == two.choices[1].message.content
    assert two.usage.completion_tokens == 10

    def sampled(seed):
        r = client.chat.completions.create(
            model="HuggingFaceTB/SmolLM2-135M-Instruct",  # the repo id names it too
            messages=[{"role": "user", "content": "Say a random word."}],
            max_tokens=8,
            temperature=1.5,
            seed=seed,
            n=2,
        )
        return [c.message.content for c in r.choices]

    assert sampled(7) == sampled(7)  # seeded: the same answers again
    assert sampled(-1) != sampled(-1)  # -1: a new random seed each time, as llama.cpp's


def test_logprobs_bytes_of_tokens_that_hold_part_of_a_character(server):
    """Emoji come in byte pieces: each piece's text is U+FFFD, its bytes are its own, and
    the bytes of the answer's tokens join to the answer (what OpenAI's bytes are for)."""
    r = server.client().chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Écris une phrase: 你好世界，我喜欢吃饺子。😀😃😄"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert any(e.token == "\ufffd" for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8") == text
    assert all(e.top_logprobs[0].bytes == e.bytes for e in content)  # greedy
    assert b"\xef\xbf\xbd" not in b"".join(bytes(e.bytes) for e in content)


def test_response_format_holds_the_answer_to_json(server):
    """A json_schema answer parses and matches the schema (the engine's tokens are checked
    against llguidance's reference in tests/test_grammar.py), taking the key the schema
    forces as drafts; json_object gives an object; the same schema through Anthropic's
    output_config.format gives the same text."""
    client = server.client()
    form = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    r = chat(client, {}, max_tokens=64, response_format=form)
    answer = json.loads(r.choices[0].message.content)
    assert (
        set(answer) == {"city", "country"}
        and answer["country"] in CITY["properties"]["country"]["enum"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.accepted_prediction_tokens >= 2  # ', "country":'
    obj = chat(client, {}, max_tokens=64, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    body = {
        "model": "smollm2-135m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": QUESTION}],
        "output_config": {"format": {"type": "json_schema", "schema": CITY}},
    }
    msg = server.http("POST", "/v1/messages", json=body).json()
    assert msg["content"] == [{"type": "text", "text": r.choices[0].message.content}]


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(server, default_model):
    """echo with logprobs and max_tokens 0 (a loglikelihood request of lm-eval and the
    like): the prompt comes back with each token's logprob as one forward pass of the
    model gives it; with max_tokens the answer follows it."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tok = default_model.tokenizer
    ids = tok.encode("The capital of France is Paris.", add_special_tokens=False)
    out = default_model.model(mx.array(ids)[None], cache=make_prompt_cache(default_model.model))
    lps = out[0].astype(mx.float32) - mx.logsumexp(out[0].astype(mx.float32), -1, keepdims=True)
    ref = [lps[i, t].item() for i, t in enumerate(ids[1:])]
    best = [tok.decode([t]) for t in mx.argmax(lps[:-1], axis=-1).tolist()]

    client = server.client()
    r = client.completions.create(
        model="smollm2-135m", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    c = r.choices[0]
    assert c.text == tok.decode(ids) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(ref, abs=2e-4)
    assert [max(top, key=top.get) for top in lp.top_logprobs[1:]] == best
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]

    more = client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=2, echo=True,
        temperature=0,
    )  # fmt: skip
    assert more.choices[0].text == "The capital of France is Paris."
    assert more.choices[0].logprobs is None

    # a prompt of one token: nothing in it is scored, the answer's token is
    one = client.completions.create(
        model="smollm2-135m", prompt=ids[:1], max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    lp = one.choices[0].logprobs
    assert lp.tokens[0] == tok.decode(ids[:1]) and len(lp.tokens) == 2
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1] < 0


def test_penalties_and_logit_bias_reach_the_answer(server, default_model):
    """The openai client's presence_penalty, frequency_penalty and logit_bias: the answer
    is mlx-lm's greedy answer with OpenAI's penalties written out, and a +100 bias makes
    one token the whole answer, in chat and text completions alike."""
    from mlxkv.engine.request import encode_prompt
    from tests.mlx_lm_ref import answer_penalties, greedy_tokens

    client = server.client()
    tok = default_model.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    ids = encode_prompt(tok, text)
    first = greedy_tokens(default_model, ids, 1, [])[0]  # "The" of the plain answer
    penalties = [answer_penalties(len(ids), 0.5, 1.0, {first: -100})]
    ref = greedy_tokens(default_model, ids, MAX_TOKENS, penalties, tok.eos_token_ids)
    ends = [i for i, t in enumerate(ref) if t in tok.eos_token_ids]
    ref = ref[: ends[0]] if ends else ref
    r = chat(client, {}, presence_penalty=0.5, frequency_penalty=1.0, logit_bias={first: -100})
    assert r.choices[0].message.content == tok.decode(ref)
    assert r.choices[0].message.content != chat(client, {}).choices[0].message.content

    the = tok.encode(" the")[-1]
    only = client.completions.create(
        model="smollm2-135m", prompt="Once", max_tokens=4, temperature=0, logit_bias={str(the): 100}
    )
    assert only.choices[0].text == " the the the the"


def test_an_answer_cut_inside_a_character_leaves_it_out(server, default_model):
    """max_tokens that end an answer inside a character (an emoji is three tokens of the
    default model) leave the character out, whole or streamed, where it was U+FFFD."""
    emoji = default_model.tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) == 3  # its four bytes in three tokens
    client = server.client()
    ask = {"model": "smollm2-135m", "prompt": "Once", "max_tokens": 1, "temperature": 0}
    ask["logit_bias"] = {str(emoji[0]): 100}
    whole = client.completions.create(**ask)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == ("", "length")
    assert whole.usage.completion_tokens == 1
    parts = client.completions.create(**ask, stream=True)
    assert "".join(c.choices[0].text for c in parts if c.choices) == ""


def test_answers_of_a_set_length_as_benchmarks_ask(server, default_model):
    """vLLM's and llama.cpp's fields through the openai client's extra_body: ignore_eos
    gives max_tokens tokens, chat and text completions alike; min_tokens keeps a short
    answer going past its EOS; mlx_lm.server's repetition_context_size sets the window of
    the repetition penalty (mlx-lm's own tokens with that window)."""
    from mlx_lm.sample_utils import make_logits_processors

    from mlxkv.engine.request import encode_prompt
    from tests.mlx_lm_ref import greedy_tokens

    client = server.client()
    sky = [{"role": "user", "content": "Reply with one word: is the sky blue?"}]
    ask = {"model": "smollm2-135m", "messages": sky, "temperature": 0, "max_tokens": 16}
    plain = client.chat.completions.create(**ask)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 9
    long = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 16
    assert long.choices[0].message.content.startswith(plain.choices[0].message.content)
    more = client.chat.completions.create(**ask, extra_body={"min_tokens": 12})
    assert more.usage.completion_tokens > 12
    assert more.choices[0].message.content.startswith(plain.choices[0].message.content)
    text = client.completions.create(
        model="smollm2-135m",
        prompt="Hi",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert text.usage.completion_tokens == 8 and text.choices[0].finish_reason == "length"

    tok = default_model.tokenizer
    chat = [{"role": "user", "content": "List the days of the week, twice, then count to 20."}]
    ids = encode_prompt(
        tok, tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    ref, short = (
        greedy_tokens(default_model, ids, 6, make_logits_processors(None, 1.3, size))
        for size in (64, 20)
    )
    got = client.chat.completions.create(
        model="smollm2-135m", messages=chat, temperature=0, max_tokens=6,
        extra_body={"repetition_penalty": 1.3, "repetition_context_size": 64},
    )  # fmt: skip
    assert got.choices[0].message.content == tok.decode(ref) != tok.decode(short)


def test_llama_vims_instructions_warm_the_cache_then_stream(server):
    """llama.vim's instruct mode, as it talks to llama.cpp's server: a warm-up with its own
    fields (n_predict 0: prefill only, and answer nothing), then the instruction streamed,
    whose prompt the warm-up's prefill serves but for the answer's opening."""
    chat = [
        {"role": "system", "content": "You edit code as instructed."},
        {"role": "user", "content": "Rename x to count:\n\nx = 0\nx += 1\nprint(x)\n"},
    ]
    warm = {"id_slot": 0, "messages": chat, "samplers": [], "n_predict": 0, "stream": False}
    warm |= {"cache_prompt": True, "response_fields": [""]}
    r = _post(server, warm)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["message"]["content"] == ""
    assert (out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]) == ("length", 0)
    prompt = out["usage"]["prompt_tokens"]
    ask = {"id_slot": 0, "messages": chat, "min_p": 0.1, "temperature": 0.1, "stream": True}
    ask |= {"samplers": ["min_p", "temperature"], "cache_prompt": True, "n_predict": 8}
    ask |= {"stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=ask, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = chunks[-1]["usage"]
    assert text and usage["completion_tokens"] <= 8 and usage["prompt_tokens"] == prompt
    assert usage["prompt_tokens_details"]["cached_tokens"] >= prompt - 1


def test_llama_vscode_reads_the_context_and_counts_a_chat_as_llama_cpp_answers(
    server, default_model
):
    """llama.cpp's /props (llama.vscode sizes its prompts by n_ctx) and /apply-template,
    whose text /tokenize (llama.cpp's form) counts as many tokens as the chat completion
    reads; both refuse in llama.cpp's error shape."""
    props = server.http("GET", "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 8192
    assert (props["total_slots"], props["model_alias"]) == (16, "smollm2-135m")
    assert props["chat_template"] == default_model.tokenizer.chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = server.http("POST", "/apply-template", json={"messages": chat})
    prompt = r.json()["prompt"]
    assert prompt == default_model.tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    body = {"content": prompt, "add_special": False, "parse_special": True}
    tokens = server.http("POST", "/tokenize", json=body).json()["tokens"]
    used = (
        server.client()
        .chat.completions.create(model="smollm2-135m", messages=chat, max_tokens=1)
        .usage.prompt_tokens
    )
    assert len(tokens) == used
    r = server.http("POST", "/apply-template", json={"messages": chat, "add_generation_prompt": 1})
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "code": 400,
            "message": "add_generation_prompt is not a field of /apply-template; send messages",
            "type": "invalid_request_error",
        }
    }


def test_llama_cpps_completion_continues_a_prompt_as_v1_completions_does(server, default_model):
    """llama.cpp's native /completion: the text /v1/completions gives the same prompt (as
    text or token ids), streamed the same, in llama.cpp's objects; a stop word is named."""
    prompt = "The capital of France is"
    ref = server.client().completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=8, temperature=0
    )
    ask = {"prompt": prompt, "n_predict": 8, "temperature": 0}
    out = server.http("POST", "/completion", json=ask).json()
    assert out["content"] == ref.choices[0].text
    assert (out["stop_type"], out["tokens_predicted"]) == ("limit", 8)
    assert out["tokens_evaluated"] == ref.usage.prompt_tokens
    ids = default_model.tokenizer.encode(prompt)
    out = server.http("POST", "/completion", json={**ask, "prompt": ids}).json()
    assert out["content"] == ref.choices[0].text
    with httpx.stream("POST", f"{server.url}/completion", json={**ask, "stream": True}) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    assert "".join(x["content"] for x in lines) == ref.choices[0].text
    assert [x["stop"] for x in lines][-2:] == [False, True]
    cut = ref.choices[0].text.split(".")[0]
    out = server.http("POST", "/completion", json={**ask, "stop": ["."]}).json()
    assert (out["content"], out["stop_type"], out["stopping_word"]) == (cut, "word", ".")
    for body, message in (
        ({"prompt": ""}, "prompt must be a non-empty string or a list of token ids in [0, 49152)"),
        ({"prompt": "x", "input_prefix": "y"}, "input_prefix is not a field of /completion here"),
    ):
        r = server.http("POST", "/completion", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message)


def test_sixteen_streams_decode_as_one_batch(server):
    client = server.client()
    alone = client.completions.create(
        model="smollm2-135m", prompt=COUNTING, max_tokens=12, temperature=0
    ).choices[0]
    texts = [None] * 16

    def one(i):
        stream = client.completions.create(
            model="smollm2-135m", prompt=COUNTING, max_tokens=12, temperature=0, stream=True
        )
        texts[i] = "".join(p.choices[0].text for p in stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert texts == [alone.text] * 16  # batched greedy == alone
    status = server.wait_idle()
    assert status["max_rows_in_a_step"] == 16


def test_a_closed_stream_frees_its_row(server):
    client = server.client()
    before = server.wait_idle()["requests_finished"]
    stream = client.completions.create(
        model="smollm2-135m", prompt=COUNTING, max_tokens=2400, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert len(server.status()["running"]) == 1
    stream.close()  # the client goes away mid-answer
    after = server.wait_idle()
    assert after["requests_finished"] == before + 1
    assert re.search(r"cmpl-\w+ ended after \d+ tokens, unfinished", server.log())


def test_a_client_that_stops_waiting_frees_its_row(server):
    """Not streaming: the client gives up while the whole answer is being made."""
    before = server.wait_idle()["requests_finished"]
    cut = re.compile(r"cmpl-\w+ ended after (\d+) tokens, unfinished")
    seen = len(cut.findall(server.log()))
    body = {"prompt": COUNTING, "max_tokens": 4000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=3))
    after = server.wait_idle()
    assert after["requests_finished"] == before + 1
    found = cut.findall(server.log())
    assert len(found) == seen + 1 and int(found[-1]) < 4000


def _post(server, body, path="/v1/chat/completions", **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return server.http("POST", path, content=body, **kw)
    return server.http("POST", path, json=body, **kw)


MSG = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = [  # (body, path, status, param, words in the message)
    (b"{not json", None, 400, None, "not valid JSON"),
    (b"[1, 2]", None, 400, None, "must be a JSON object"),
    (b'{"messages": "\xff\xfe"}', None, 400, None, "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None, 400,
     "messages[0].content", "lone surrogate"),
    (b'{"messages": [], "temperature": NaN}', None, 400, None, "not a JSON number"),
    ({"messages": []}, None, 400, "messages", "non-empty list"),
    ({"model": "smollm2-135m"}, None, 400, "messages", "messages is required"),
    ({"messages": [{"role": "robot", "content": "x"}]}, None, 400, "messages[0].role", "robot"),
    ({"messages": [{"role": "tool", "content": "x"}]}, None, 400, "messages[0].tool_call_id",
     "must be the id of the call"),
    ({"messages": [{"role": "function", "content": "x"}]}, None, 400, "messages[0].role",
     "retired form of role 'tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400,
     "messages[0].content", "only text parts"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, None, 400, "tools[0].function",
     "tools[0].function must be an object with a name"),
    ({"messages": MSG, "tools": {"type": "function"}}, None, 400, "tools", "must be a list"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, None, 400, "response_format",
     "response_format.type must be 'text', 'json_object' or 'json_schema', got \"xml\""),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     None, 400, "response_format.json_schema.name", "name must be 1 to 64 letters"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(("}}}}, None, 400,
     "response_format.json_schema.schema",
     "the JSON schema cannot be used: regex parse error: (( ^ error: unclosed group"),
    ({"messages": MSG, "presence_penalty": 2.5}, None, 400, "presence_penalty",
     "presence_penalty must be in [-2, 2], got 2.5; 0 means none"),
    ({"messages": MSG, "frequency_penalty": "high"}, None, 400, "frequency_penalty",
     'frequency_penalty must be a number, got "high"'),
    ({"messages": MSG, "logit_bias": [5]}, None, 400, "logit_bias", "must be an object"),
    ({"messages": MSG, "logit_bias": {"the": 1}}, None, 400, "logit_bias",
     'logit_bias key "the" is not a token id of this model; keys are token ids in [0, 49152)'),
    ({"messages": MSG, "logit_bias": {"49152": 1}}, None, 400, "logit_bias", "in [0, 49152)"),
    ({"messages": MSG, "logit_bias": {"9" * 5000: 1}}, None, 400, "logit_bias",
     'logit_bias key "' + "9" * 36 + '... is not a token id of this model'),
    ({"messages": MSG, "logit_bias": {"5": 101}}, None, 400, "logit_bias",
     'logit_bias["5"] must be a number in [-100, 100], got 101'),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "/v1/completions", 400,
     "logit_bias", "logit_bias holds 1025 tokens; at most 1024"),
    ({"messages": MSG, "prompt_cache_key": 5}, None, 400, "prompt_cache_key",
     "prompt_cache_key must be a string, got 5"),
    ({"messages": MSG, "prompt_cache_retention": "1h"}, None, 400, "prompt_cache_retention",
     "prompt_cache_retention must be 'in_memory' or '24h', got \"1h\""),
    ({"messages": MSG, "store": True}, None, 400, "store",
     "store: storing completions is not supported; leave 'store' out"),
    ({"messages": MSG, "verbosity": "terse"}, None, 400, "verbosity",
     "verbosity: verbosity must be one of low, medium, high"),
    ({"messages": MSG, "service_tier": "flex"}, None, 400, "service_tier",
     "service_tier: there is one service tier; send 'auto' or leave it out"),
    ({"messages": MSG, "modalities": ["text", "audio"]}, None, 400, "modalities",
     'only text output is supported (modalities ["text"])'),
    ({"messages": MSG, "audio": {"voice": "alloy", "format": "wav"}}, None, 400, "audio",
     "audio: audio output is not supported"),
    ({"messages": MSG, "foo": 1}, None, 400, "foo", "Unrecognized request argument supplied: foo"),
    ({"messages": MSG, "temperature": "hot"}, None, 400, "temperature", "must be a number"),
    ({"messages": MSG, "temperature": 3}, None, 400, "temperature", "in [0, 2]"),
    ({"messages": MSG, "max_tokens": 0}, None, 400, "max_tokens", "in [1,"),
    ({"messages": MSG, "max_tokens": 2.5}, None, 400, "max_tokens", "must be an integer"),
    ({"messages": MSG, "max_tokens": 5, "max_completion_tokens": 6}, None, 400,
     "max_completion_tokens", "disagree"),
    ({"messages": MSG, "top_p": 0}, None, 400, "top_p", "in (0, 1]"),
    ({"messages": MSG, "seed": -2}, None, 400, "seed",
     "seed must be in [0, 18446744073709551615], got -2; -1 means a random seed"),
    ({"messages": MSG, "n": 0}, None, 400, "n", "got 0; the server takes at most"),
    ({"messages": MSG, "stop": [""]}, None, 400, "stop", "must not be empty"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, None, 400, "messages[0].role",
     'messages[0].role must be one of system, developer, user, assistant, tool, got ["user"]'),
    ({"messages": MSG, "stop": 5}, None, 400, "stop", "string or a list"),
    ({"messages": MSG, "stop": ["x"] * 65}, None, 400, "stop", "at most 64 strings, got 65"),
    ({"messages": MSG, "top_logprobs": 2}, None, 400, "top_logprobs", "needs logprobs"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, None, 400,
     "stream_options", "only allowed with stream"),
    ({"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, None, 400,
     "chat_template_kwargs.tokenize", "set by the server"),
    ({"messages": MSG, "kv": {"window": 4, "sinks": 8}}, None, 400, "kv",
     "kv.window (4) must be larger than kv.sinks (8)"),
    ({"messages": MSG, "kv": {"bits": 7}}, None, 400, "kv", "kv.bits 7 is not supported"),
    ({"messages": MSG, "kv": {"group_size": 32}}, None, 400, "kv",
     "kv.group_size applies to a quantized cache; add kv.bits B"),
    ({"messages": MSG, "kv": {"turbo": 1}}, None, 400, "kv.turbo", "not a KV policy field"),
    ({"messages": MSG, "kv": {"window": "big"}}, None, 400, "kv.window", "must be an integer"),
    ({"messages": MSG, "model": "gpt-4o"}, None, 404, "model", "does not exist on this server"),
    ({"messages": MSG, "model": "/root/.cache/mlxkv/models/smollm2-135m"}, None, 404, "model",
     "serves 'smollm2-135m'"),
    ({"messages": [{"role": "user", "content": "hello " * 9000}]}, None, 400, "messages",
     "model's context is 8192; shorten it or use a window (kv.window)"),
    ({"prompt": [1, 2, 99999999]}, "/v1/completions", 400, "prompt", "outside the vocabulary"),
    ({"prompt": ""}, "/v1/completions", 400, "prompt", "is empty"),
    ({"prompt": "x", "echo": True, "stream": True}, "/v1/completions", 400, "echo",
     "echo is not supported with stream: true; ask for the whole answer"),
    ({"prompt": "x", "max_tokens": 0}, "/v1/completions", 400, "max_tokens", "in [1,"),
    ({"prompt": "x", "best_of": 2}, "/v1/completions", 400, "best_of", "not supported"),
    ({"prompt": "x", "messages": MSG}, "/v1/completions", 400, "messages", "Unrecognized"),
    ({"messages": MSG, "max_tokens": 6, "n_predict": 5}, None, 400, "n_predict",
     "max_tokens (6) and n_predict (5) disagree; send one"),
    ({"messages": MSG, "samplers": 5}, None, 400, "samplers",
     "samplers must be a list of at most 64 strings"),
    ({"messages": MSG, "id_slot": -2}, None, 400, "id_slot",
     "id_slot must be in [-1, 2147483647], got -2; -1: any"),
    ({"messages": MSG, "max_tokens": 5, "min_tokens": 6}, None, 400, "min_tokens",
     "min_tokens (6) is more than max_tokens (5); lower min_tokens or raise max_tokens"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "/v1/completions", 400, "min_tokens",
     "min_tokens (3) is more than max_tokens (2)"),
    ({"messages": MSG, "min_tokens": -1}, None, 400, "min_tokens",
     "min_tokens must be in [0, 2147483647], got -1"),
    ({"messages": MSG, "ignore_eos": "yes"}, None, 400, "ignore_eos",
     'ignore_eos must be true or false, got "yes"'),
    ({"messages": MSG, "ignore_eos": True, "response_format": {"type": "json_object"}}, None,
     400, "ignore_eos", "ignore_eos cannot go with response_format or a forced tool call: that "
     "answer ends where its schema does; leave ignore_eos out"),
    ({"messages": MSG, "xtc_threshold": 0.7}, None, 400, "xtc_threshold",
     "xtc_threshold must be in [0, 0.5], got 0.7"),
    ({"messages": MSG, "xtc_probability": 2}, None, 400, "xtc_probability",
     "xtc_probability must be in [0, 1], got 2; 0 means none"),
    ({"messages": MSG, "repetition_context_size": 0}, None, 400, "repetition_context_size",
     "repetition_context_size must be in [1, 1048576], got 0"),
    ({"messages": MSG, "prediction": "Hello"}, None, 400, "prediction",
     'prediction must be {"type": "content", "content": "the expected answer"}'),
    ({"messages": MSG, "prediction": {"type": "content", "content": 5}}, None, 400,
     "prediction.content", "prediction.content must be a string or a list of text parts"),
    ({"messages": MSG, "prediction": {"type": "content", "content": "ab " * 250000}}, None, 400,
     "prediction", "prediction has 750000 characters, more than an answer in a 8192-token "
     "context can hold; shorten it"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=lambda c: str(c[4])[:40])
def test_bad_requests_get_an_openai_error(server, case):
    body, path, status, param, words = case
    r = _post(server, body, path or "/v1/chat/completions")
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err["message"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert "\n" not in err["message"] and "Traceback" not in r.text


def test_unknown_endpoints_and_methods(server):
    r = server.http("GET", "/v1/engines")
    assert r.status_code == 404 and "no endpoint GET /v1/engines" in r.json()["error"]["message"]
    r = server.http("GET", "/v1/chat/completions")
    assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"]


def test_the_servers_log_says_why_a_request_was_refused(server):
    """A client that shows its user a bare status code leaves the reason to the server's
    log: one line each, with what the request quoted escaped (no forged lines, no escape
    sequences for the operator's terminal)."""
    before = len(server.log())
    r = server.http("POST", "/v1/chat/completions", json={"messages": MSG, "audio": {}})
    assert r.status_code == 400
    forged = "gpt\x1b[2J\nmlxkv: forged"
    r = server.http("POST", "/v1/chat/completions", json={"model": forged, "messages": MSG})
    assert r.status_code == 404
    r = server.http("POST", "/api/chat", json={"model": "smollm2-135m", "messages": "x"})
    assert r.status_code == 400
    said = [line for line in server.log()[before:].splitlines() if line.startswith("mlxkv: ")]
    assert said == [
        "mlxkv: POST /v1/chat/completions 400: audio: audio output is not supported",
        "mlxkv: POST /v1/chat/completions 404: The model 'gpt\\x1b[2J\\nmlxkv: forged' does "
        "not exist on this server: it serves 'smollm2-135m' (GET /v1/models); the model is "
        "chosen when mlxkv serve starts (--served-model-name gives it more names)",
        "mlxkv: POST /api/chat 400: messages must be a list of {role, content} objects",
    ]


def test_the_openai_client_sees_the_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSG)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2-135m",
            messages=MSG,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert e.value.body == {
        "message": "the model 'smollm2-135m' cannot call tools: its chat template has no "
        "tool-call format mlx-lm knows; leave 'tools' out, send tool_choice 'none', or force "
        "a call (tool_choice 'required' or a function's name)",
        "type": "invalid_request_error",
        "param": "tools",
        "code": "tools_unsupported",
    }
    # with tool_choice "none" the tools stay out of the prompt: any model answers
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=MSG,
        max_tokens=2,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="none",
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    # a forced call is JSON held to the schema: any model writes it (pydantic-ai's and
    # instructor's structured output force one); the template does not show it the tools
    city = {"type": "string", "enum": ["Paris", "Rome"]}
    params = {"type": "object", "properties": {"city": city}, "required": ["city"]}
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        tools=[{"type": "function", "function": {"name": "answer", "parameters": params}}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=32,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "answer"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_parameters_sent_with_their_no_op_values_are_answered(server):
    """What clients send as defaults, or copy back from an earlier answer (OpenAI names its
    standard tier "default"; GPT-5's clients send a verbosity, a hint the model here does
    not take, as the Responses API's text.verbosity), is taken: the answer is the one
    without them."""
    client = server.client()
    plain = client.chat.completions.create(
        model="smollm2-135m", messages=MSG, max_tokens=6, temperature=0
    )
    for tier, verbosity in (("auto", "low"), ("default", "high")):
        r = client.chat.completions.create(
            model="smollm2-135m",
            messages=MSG,
            max_tokens=6,
            temperature=0,
            store=False,
            metadata={},
            modalities=["text"],
            service_tier=tier,
            verbosity=verbosity,
            extra_body={"functions": [], "function_call": "none"},
        )
        assert r.choices[0].message.content == plain.choices[0].message.content


def test_a_participants_name_reaches_the_template(server, default_model):
    """Multi-agent frameworks name each message's author (OpenAI's ``name``): the message
    is taken and the template reads it."""
    chat = [{"role": "user", "content": QUESTION, "name": "planner"}]
    r = server.http("POST", "/v1/chat/completions", json={"messages": chat, "max_tokens": 1})
    assert r.status_code == 200, r.text
    tok = default_model.tokenizer
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    from mlxkv.engine.request import encode_prompt

    assert r.json()["usage"]["prompt_tokens"] == len(encode_prompt(tok, text))
    bad = [{"role": "user", "content": QUESTION, "name": 5}]
    r = server.http("POST", "/v1/chat/completions", json={"messages": bad, "max_tokens": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "messages[0].name must be a non-empty string"


def test_without_a_key_only_this_machine_is_served(server):
    """A web page elsewhere (its Origin) or a DNS name rebound to 127.0.0.1 (its Host)."""
    for headers in (
        {"Host": "evil.example:8080"},
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
    ):
        r = server.http("POST", "/v1/chat/completions", headers=headers, json={"messages": MSG})
        assert r.status_code == 403, headers
        err = r.json()["error"]
        assert err["code"] == "forbidden_origin"
        assert err["message"].startswith("this server has no API key, so it answers this machine")
    for headers in ({"Host": "localhost:1"}, {"Origin": "http://127.0.0.1:3000"}):
        assert server.http("GET", "/v1/models", headers=headers).status_code == 200


LOCAL_PAGES = (
    "http://localhost:3000",
    "http://127.0.0.1:8000",
    "http://[::1]:5173",
    "app://obsidian.md",
    "vscode-webview://1abc",
    "tauri://localhost",
    "file://",
)


def test_this_machines_pages_may_call_the_api_from_a_browser(server):
    """A web UI on localhost or an app's page (Electron, Tauri, VS Code's webviews) gets its
    CORS preflight answered and the answers' CORS header; a page elsewhere gets neither."""
    ask = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization",
    }
    for origin in LOCAL_PAGES:
        for path in ("/v1/chat/completions", "/api/chat", "/v1/messages"):
            r = server.http("OPTIONS", path, headers={"Origin": origin, **ask})
            assert r.status_code == 200, (origin, path)
            assert r.headers["access-control-allow-origin"] == origin
            assert "POST" in r.headers["access-control-allow-methods"]
            assert r.headers["access-control-allow-headers"] == "content-type, authorization"
        body = {"messages": MSG, "max_tokens": 1}
        r = server.http("POST", "/v1/chat/completions", headers={"Origin": origin}, json=body)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    for origin in ("http://evil.example", "null", "chrome-extension://abc"):
        r = server.http("OPTIONS", "/v1/chat/completions", headers={"Origin": origin, **ask})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = server.http("GET", "/v1/models", headers={"Origin": origin})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_models_health_and_status(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    assert models.data[0].max_model_len == 8192  # the model's context, as vLLM lists it
    assert models.data[0].context_length == 8192  # and as OpenRouter does
    assert server.client().models.retrieve("smollm2-135m").id == "smollm2-135m"
    assert server.http("GET", "/health").json() == {"status": "ok", "model": "smollm2-135m"}
    s = server.status()
    assert s["policy"] == "full" and s["max_batch"] == 16


def test_the_server_module_runs_no_mlx():
    """mlxkv/server talks to the scheduler only: no module of it imports MLX."""
    for path in (ROOT / "mlxkv" / "server").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "mlx" or n.startswith(("mlx.", "mlx_lm")) for n in names), path


def test_tokenize_counts_what_the_endpoints_would_read(server, default_model):
    """vLLM's /tokenize (``prompt``, ``messages``) and llama.cpp's (``content``): the ids a
    completion or a chat completion would read (its ``prompt_tokens``), the context beside
    the count, and /detokenize back to the text."""
    from mlxkv.engine.request import encode_prompt

    tok = default_model.tokenizer
    text = "The capital of France is"
    r = server.http("POST", "/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = encode_prompt(tok, text)
    assert r.json() == {
        "count": len(ids),
        "max_model_len": 8192,
        "tokens": ids,
        "token_strs": tok.convert_ids_to_tokens(ids),
    }
    back = server.http("POST", "/detokenize", json={"model": "smollm2-135m", "tokens": ids})
    assert back.json() == {"prompt": text, "content": text}

    chat = server.client().chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=1)
    whole = server.http("POST", "/tokenize", json={"messages": MSG}).json()
    assert whole["count"] == chat.usage.prompt_tokens == len(whole["tokens"])
    body = {"messages": MSG, "add_generation_prompt": False}
    bare = server.http("POST", "/tokenize", json=body).json()["tokens"]
    assert whole["tokens"][: len(bare)] == bare and len(bare) < whole["count"]

    r = server.http("POST", "/tokenize", json={"content": "café 🎉", "with_pieces": True})
    pieces = r.json()["tokens"]
    assert pieces == [
        {"id": 83, "piece": "c"},
        {"id": 1939, "piece": "af"},
        {"id": 2756, "piece": "é"},
        {"id": 15107, "piece": [32, 240, 159]},  # a space and part of the emoji: its bytes
        {"id": 232, "piece": [142]},
        {"id": 227, "piece": [137]},
    ]
    assert server.http("POST", "/tokenize", json={"content": "café 🎉"}).json() == {
        "tokens": [p["id"] for p in pieces]
    }


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        ("/tokenize", {}, None, "send the text to tokenize as one of 'prompt' (a string), "
         "'messages' (a chat) or 'content' (a string)"),
        ("/tokenize", {"prompt": "a", "content": "b"}, None, "send the text to tokenize as"),
        ("/tokenize", {"prompt": 5}, "prompt", "prompt must be a string, got 5"),
        ("/tokenize", {"content": "x", "add_special_tokens": True}, "add_special_tokens",
         "add_special_tokens does not go with 'content' in /tokenize (it takes add_special, "
         "model, parse_special, with_pieces)"),
        ("/tokenize", {"content": "x", "parse_special": False}, None,
         "parse_special false is not supported: special tokens in the text are read"),
        ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs",
         'return_token_strs must be true or false, got "yes"'),
        ("/tokenize", {"messages": []}, "messages", "messages"),
        ("/tokenize", {"model": "gpt-4o", "prompt": "x"}, "model", "The model 'gpt-4o' does "
         "not exist on this server"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "token id -1 is not in [0, 49152)"),
        ("/detokenize", {"tokens": [49152]}, "tokens", "token id 49152 is not in [0, 49152)"),
        ("/detokenize", {"tokens": [1.5]}, "tokens",
         "tokens must be a list of token ids (integers)"),
        ("/detokenize", {"tokens": [1], "x": 1}, "x",
         "Unrecognized request argument supplied: x"),
    ],
)  # fmt: skip
def test_tokenize_and_detokenize_refuse_what_they_cannot_read(server, path, body, param, message):
    r = server.http("POST", path, json=body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param
