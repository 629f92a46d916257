"""OpenAI's Responses API on ``mlxkv serve`` (``POST /v1/responses``), as the newest OpenAI
clients and agent frameworks meet it: real server processes, driven by the official
``openai`` client (and raw HTTP for the stream's events and what the client would refuse
to send).

Two models: the offline default one (answers checked token for token against mlx-lm and
against the server's own chat completions), and the scripted model of
tests/test_serve_tools.py, which thinks and then calls a tool."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from pydantic import BaseModel

from tests.json_schemas import CITY
from tests.serve_helpers import Server, cut_by_shutdown, named_events, serving
from tests.test_serve_tools import ASK, MARKERS, SCRIPT, TEMPLATE, THOUGHT, WEATHER, rendered
from tests.tiny_models import scripted_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model
QUESTION = "What is the capital of France?"
TOOL = {"type": "function", **WEATHER["function"]}  # WEATHER as the Responses API writes it


def post(server: Server, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=600)


def events(server: Server, body: dict) -> list[tuple[str, dict]]:
    return named_events(server, "/v1/responses", body)


def prompt_ids(tok, chat: list[dict]) -> list[int]:
    from mlxkv.engine.request import encode_prompt

    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return encode_prompt(tok, text)


# -- the default model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("serve-responses"), "--shutdown-timeout", "2")


def test_a_response_is_mlx_lms_greedy_answer(server, default_model):
    """The whole response, its stream and a chat completion of the same conversation are
    mlx-lm's greedy tokens; the instructions reach the template as its system message."""
    from tests.mlx_lm_ref import greedy_tokens

    tok = default_model.tokenizer
    chat = [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": QUESTION},
    ]
    ids = prompt_ids(tok, chat)
    ref = greedy_tokens(default_model, ids, 40, [], tok.eos_token_ids)
    ref = ref[: ref.index(next(t for t in ref if t in tok.eos_token_ids))]

    c = server.client()
    kw = {"model": "smollm2-135m", "max_output_tokens": 40, "instructions": chat[0]["content"]}
    r = c.responses.create(input=QUESTION, **kw)
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == tok.decode(ref)
    assert (r.status, r.model, r.incomplete_details, r.instructions) == (
        "completed",
        "smollm2-135m",
        None,
        "Answer in one sentence.",
    )
    assert r.id.startswith("resp_") and r.output[0].id.startswith("msg_")
    assert r.usage.input_tokens == len(ids)
    assert r.usage.output_tokens == len(ref) + 1  # and the EOS
    assert r.usage.total_tokens == len(ids) + len(ref) + 1
    kv = r.usage.model_extra["mlxkv"]
    assert kv["kv_bytes_actual"] == kv["kv_bytes_predicted"] > 0

    with c.responses.stream(input=QUESTION, **kw) as s:
        pieces = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(pieces) == r.output_text and len(pieces) > 1
    assert final.output_text == r.output_text and final.status == "completed"
    assert final.usage.output_tokens == r.usage.output_tokens

    chat_answer = c.chat.completions.create(
        model="smollm2-135m", messages=chat, max_tokens=40, temperature=0
    )
    assert chat_answer.choices[0].message.content == r.output_text


def test_the_stream_is_the_responses_event_sequence(server):
    """Every event named as its type and numbered in order; an answer cut by
    max_output_tokens ends incomplete, its message item too."""
    ev = events(
        server,
        {"model": "smollm2-135m", "max_output_tokens": 6, "input": QUESTION, "stream": True},
    )
    names = [n for n, _ in ev]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[4:-4] == ["response.output_text.delta"] * 6
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [d["sequence_number"] for _, d in ev] == list(range(len(ev)))
    created = ev[0][1]["response"]
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    item = ev[2][1]["item"]
    assert (item["type"], item["status"], item["content"]) == ("message", "in_progress", [])
    text = "".join(d["delta"] for n, d in ev if n == "response.output_text.delta")
    assert text == "The capital of France is Paris" == ev[-4][1]["text"]
    assert ev[-2][1]["item"]["status"] == "incomplete"
    last = ev[-1][1]["response"]
    assert (last["status"], last["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert last["usage"]["output_tokens"] == 6 and last["output"][0]["content"][0]["text"] == text


def test_previous_response_id_goes_on_from_the_stored_conversation(server, default_model):
    """A response sent with previous_response_id reads the stored turns before it (the
    instructions are not carried), as if the conversation had been sent again, and the
    prefix cache serves the turn before; the stored response can be read back, listed
    and deleted, and a chain with a deleted link is refused."""
    tok = default_model.tokenizer
    c = server.client()
    kw = {"model": "smollm2-135m", "max_output_tokens": 40}
    first = c.responses.create(input=QUESTION, instructions="Be brief.", **kw)
    second = c.responses.create(input="And of Italy?", previous_response_id=first.id, **kw)
    chat = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ]
    assert second.usage.input_tokens == len(prompt_ids(tok, chat))
    assert second.previous_response_id == first.id and second.instructions is None

    again = c.responses.create(
        input=[
            {"role": "user", "content": QUESTION},
            *[o.model_dump(exclude_none=True) for o in first.output],
            {"role": "user", "content": "And of Italy?"},
        ],
        store=False,
        **kw,
    )
    assert again.output_text == second.output_text
    assert again.usage.input_tokens == second.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens > first.usage.input_tokens

    n = c.responses.input_tokens.count(
        model="smollm2-135m", input="And of Italy?", previous_response_id=first.id
    )
    assert (n.object, n.input_tokens) == ("response.input_tokens", second.usage.input_tokens)

    assert c.responses.retrieve(second.id).output_text == second.output_text
    held = server.status()["response_store"]
    assert held["responses"] >= 2 and 0 < held["bytes"] <= held["limit"] == 64 * 2**20
    listed = c.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [
        ("message", "user", "And of Italy?")
    ]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(again.id)  # store false

    assert c.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(input="And of Spain?", previous_response_id=second.id, **kw)
    assert e.value.body["code"] == "previous_response_not_found"
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["message"].startswith(
        f"Previous response with id '{second.id}' not found (the response '{first.id}' before it)"
    )


def test_text_format_holds_the_answer_to_a_schema(server):
    class City(BaseModel):  # parse() sends it as a strict json_schema format
        city: str
        country: str

    c = server.client()
    r = c.responses.create(
        model="smollm2-135m",
        input="Name a city in Italy as JSON with its country.",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
    )
    answer = json.loads(r.output_text)
    assert set(answer) == {"city", "country"}
    assert answer["country"] in ("France", "Germany", "Italy")
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"

    parsed = c.responses.parse(
        model="smollm2-135m",
        input="Name a city in Italy as JSON with its country.",
        max_output_tokens=60,
        text_format=City,
    )
    assert isinstance(parsed.output_parsed, City)


def test_logprobs_come_with_the_output_text(server):
    """include message.output_text.logprobs: each token of the text with its logprob and
    alternatives, the same figures a chat completion gives."""
    c = server.client()
    r = c.responses.create(
        model="smollm2-135m",
        input=QUESTION,
        max_output_tokens=6,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    part = r.output[0].content[0]
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    chat = c.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    want = [(e.token, e.logprob) for e in chat.choices[0].logprobs.content]
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == pytest.approx(want, abs=1e-4)


BAD = [
    ({"model": "gpt-5"}, 404, "model", None),
    ({"frobnicate": 1}, 400, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ({"input": None}, 400, "input", "input is required: a string or a list of input items"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        400,
        "input[0].content[0]",
        "input[0].content[0]: only text parts are supported (got 'input_image')",
    ),
    (
        {"input": [{"type": ["message"], "role": "user", "content": "hi"}]},
        400,
        "input[0].type",
        "input[0].type must be a string, such as 'message'",
    ),
    (
        {"input": [{"role": ["user"], "content": "hi"}]},
        400,
        "input[0].role",
        'input[0].role must be one of system, developer, user, assistant, got ["user"]',
    ),
    (
        {"input": [{"role": "user", "content": [{"type": [], "text": "hi"}]}]},
        400,
        "input[0].content[0]",
        "input[0].content[0]: only text parts are supported",
    ),
    (
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        400,
        "input[0].id",
        'input[0]: item_reference "msg_1" names no item this server holds (the input and '
        "output items of stored responses, and the conversation's items); send the item "
        "itself",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
        400,
        "input[0].arguments",
        "input[0].arguments must be a JSON object written as a string; send the arguments "
        "the model's call gave",
    ),
    (
        {"tools": [{"type": "retrieval"}]},
        400,
        "tools[0].type",
        "tools[0] must be a function tool ({type: 'function', name, parameters}); "
        "'retrieval' tools are not supported",
    ),
    (
        {"tools": [{"type": "custom", "name": "patch", "format": {"type": "regex"}}]},
        400,
        "tools[0].format",
        "tools[0].format must be {type: 'text'} or {type: 'grammar', syntax, definition}, "
        'got {"type": "regex"}',
    ),
    (
        {"text": {"verbosity": "terse"}},
        400,
        "text.verbosity",
        'text.verbosity must be one of low, medium, high, got "terse"',
    ),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_time"}},
        400,
        "tool_choice",
        "tool_choice names 'get_time', which is not among the tools",
    ),
    (
        {"truncation": "middle"},
        400,
        "truncation",
        "truncation must be 'auto' or 'disabled', got \"middle\"",
    ),
    (
        {"background": True, "store": False},
        400,
        "store",
        "background responses are stored: leave store out or set it true",
    ),
    (
        {"include": ["file_search_call.results"]},
        400,
        "include",
        'include "file_search_call.results" is not supported; this server can include '
        "message.output_text.logprobs and reasoning.encrypted_content",
    ),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
        400,
        "text.format.schema",
        "the JSON schema cannot be used: Invalid type: nonsense",
    ),
    (
        {"reasoning": {"effort": "extreme"}},
        400,
        "reasoning.effort",
        "reasoning.effort must be one of none, minimal, low, medium, high, xhigh, max, got "
        '"extreme"',
    ),
    (
        {"temperature": 3},
        400,
        "temperature",
        "temperature must be in [0, 2], got 3; 0 means greedy",
    ),
    ({"max_output_tokens": 0}, 400, "max_output_tokens", None),
    (
        {"previous_response_id": "resp_nope"},
        400,
        "previous_response_id",
        None,
    ),
    (
        {"kv": {"window": 4, "sinks": 8}},
        400,
        "kv",
        "kv.window (4) must be larger than kv.sinks (8)",
    ),
]


@pytest.mark.parametrize("extra,status,param,message", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_requests_get_a_400_naming_the_field(server, extra, status, param, message):
    body = {"model": "smollm2-135m", "max_output_tokens": 8, "input": QUESTION, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = post(server, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if message is not None:
        assert err["message"] == message


def test_unknown_response_ids_get_404(server):
    for method, path in (
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("GET", "/v1/responses/resp_nope/input_items"),
    ):
        r = server.http(method, path)
        assert r.status_code == 404
        assert r.json()["error"]["message"].startswith("No response found with id 'resp_nope'")


def _until_ended(client, response_id: str, seconds: float = 300.0):
    """The stored response once it has left queued and in_progress (polled, bounded)."""
    end = time.monotonic() + seconds
    while True:
        got = client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress") or time.monotonic() > end:
            return got
        time.sleep(0.1)


def test_a_background_response_is_answered_after_the_request_returns(server):
    """background: true answers at once with the response queued and nothing written; the
    answer goes on, and GET reads it completed: the same greedy answer as without
    background. A response may go on from it once it has ended."""
    client = server.client()
    ask = {"model": server.model, "input": QUESTION, "max_output_tokens": 12, "temperature": 0}
    queued = client.responses.create(**ask, background=True)
    assert (queued.status, queued.output, queued.background) == ("queued", [], True)
    done = _until_ended(client, queued.id)
    assert done.status in ("completed", "incomplete") and done.background is True
    plain = client.responses.create(**ask)
    assert done.output_text == plain.output_text and done.output_text
    after = client.responses.create(**ask, previous_response_id=queued.id)
    assert after.status in ("completed", "incomplete")


def test_a_background_response_is_cancelled_where_it_stands(server):
    """A long background answer: a response cannot go on from it while it runs (400
    previous_response_not_finished); POST .../cancel stops it and stores it cancelled;
    cancelling again answers the same; a response that was not background cannot be
    cancelled."""
    client = server.client()
    body = {"model": server.model, "max_output_tokens": 4000, "temperature": 0}
    long = client.responses.create(
        **body, input="Count to ten thousand, one by one.", background=True
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body, input="And then?", previous_response_id=long.id)
    assert e.value.code == "previous_response_not_finished"
    assert e.value.param == "previous_response_id"
    _wait_for(lambda: client.responses.retrieve(long.id).status == "in_progress")
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"
    plain = client.responses.create(**{**body, "max_output_tokens": 2}, input=QUESTION)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(plain.id)
    assert e.value.message.endswith("only background responses can be cancelled")


def test_a_background_stream_is_read_again_from_where_it_dropped(server):
    """background with stream: the events come as they are written (created and queued
    first); a client that drops the connection after event k reads the rest from k + 1 with
    the client's own resume (``responses.stream(response_id, starting_after)``) and with a
    raw ``retrieve(stream=True, starting_after)``: the same events, numbered on without a gap,
    ending completed, and the text of both halves is the stored answer, the greedy one."""
    client = server.client()
    ask = {"model": server.model, "input": QUESTION, "max_output_tokens": 40, "temperature": 0}
    first = []
    with client.responses.stream(**ask, background=True) as s:
        for e in s:
            first.append(e)
            if e.type == "response.output_text.delta" and len(first) >= 6:
                break  # the connection drops here
    rid, k = first[0].response.id, first[-1].sequence_number
    assert [e.type for e in first[:3]] == [
        "response.created",
        "response.queued",
        "response.in_progress",
    ]
    assert first[0].response.status == "queued" and first[0].response.background is True
    assert [e.sequence_number for e in first] == list(range(k + 1))
    with client.responses.stream(response_id=rid, starting_after=k) as s:
        rest = list(s)
        final = s.get_final_response()
    raw = list(client.responses.retrieve(rid, stream=True, starting_after=k))
    assert [e.sequence_number for e in rest] == list(range(k + 1, k + 1 + len(rest)))
    seen = [(e.sequence_number, e.type, getattr(e, "delta", None)) for e in rest]
    assert [(e.sequence_number, e.type, getattr(e, "delta", None)) for e in raw] == seen
    assert rest[-1].type == "response.completed"
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    stored = client.responses.retrieve(rid)
    assert stored.status == "completed" and text == stored.output_text == final.output_text
    assert text == client.responses.create(**ask).output_text
    whole = list(client.responses.retrieve(rid, stream=True))  # from the first event again
    assert [e.sequence_number for e in whole] == list(range(k + 1 + len(rest)))


@pytest.mark.parametrize(
    ("query", "param", "message"),
    [
        (
            "stream=true",
            "stream",
            "the events of response 'ID' are not kept: only background "
            "responses created with stream: true can be streamed again (the latest 16 MiB of "
            "their events are kept, in memory); read it without stream=true",
        ),
        ("stream=maybe", "stream", 'stream must be true or false, got "maybe"'),
        (
            "stream=true&starting_after=-1",
            "starting_after",
            "starting_after must be the "
            'sequence number (0 or more) of the last event read, got "-1"',
        ),
        ("starting_after=3", "starting_after", "starting_after goes with stream=true"),
    ],
)
def test_streaming_a_response_again_refuses_what_it_cannot_do(server, query, param, message):
    """A response that was not a streamed background one has no events to stream again,
    and the query's values are checked: 400s naming the parameter."""
    rid = client_response(server)
    r = httpx.get(f"{server.url}/v1/responses/{rid}?{query}", timeout=60)
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": message.replace("ID", rid),
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


def client_response(server) -> str:
    ask = {"model": server.model, "input": QUESTION, "max_output_tokens": 2}
    return server.client().responses.create(**ask).id


def test_a_cancelled_background_stream_ends_for_its_readers(server):
    """A long background stream with a second reader following it: cancelling the response
    ends both streams where it stood (no completed event), and the stored response is
    cancelled with the text they read, which a later turn goes on from."""
    client = server.client()
    body = {"model": server.model, "max_output_tokens": 4000, "temperature": 0}
    stream = client.responses.create(
        **body, input="Count to ten thousand, one by one.", background=True, stream=True
    )
    head = [next(stream) for _ in range(8)]
    rid = head[0].response.id
    follower = client.responses.retrieve(rid, stream=True, starting_after=7)
    followed = [next(follower)]
    assert followed[0].sequence_number == 8
    assert client.responses.cancel(rid).status == "cancelled"
    tail = list(stream)
    followed += list(follower)
    assert [e.model_dump() for e in followed] == [e.model_dump() for e in tail]
    assert {e.type for e in tail} <= {"response.output_text.delta"}
    stored = client.responses.retrieve(rid)
    text = "".join(e.delta for e in head + tail if e.type == "response.output_text.delta")
    assert stored.status == "cancelled" and stored.output_text == text
    # a turn going on from it reads what it wrote, as if the conversation were sent whole
    count = client.responses.input_tokens.count
    after = count(model=server.model, input="Go on.", previous_response_id=rid)
    sent = [
        {"role": "user", "content": "Count to ten thousand, one by one."},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Go on."},
    ]
    assert after.input_tokens == count(model=server.model, input=sent).input_tokens


def test_a_background_response_deleted_while_it_runs_stays_deleted(server):
    """Deleting a background response that is still answering stops it: its end does not
    store it again, and its engine row is gone."""
    client = server.client()
    body = {"model": server.model, "max_output_tokens": 4000, "temperature": 0}
    long = client.responses.create(
        **body, input="Count to ten thousand, one by one.", background=True
    )
    _wait_for(lambda: client.responses.retrieve(long.id).status == "in_progress")
    client.responses.delete(long.id)
    server.wait_idle()  # an answer left running would be stored again at its end
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(long.id)


def _wait_for(ready, seconds: float = 120.0) -> None:
    end = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < end, "not reached in time"
        time.sleep(0.05)


def test_a_conversation_is_the_turns_before_each_response(server):
    """A conversation (OpenAI's Conversations API) made with a system item: each response
    made with it reads its items before the input, is the greedy answer to the conversation
    sent whole (the prefix cache serving the turns before), echoes it, and adds its input
    and output, streamed or not; the items list in order, as the client reads them."""
    client = server.client()
    system = {"type": "message", "role": "system", "content": "Answer in one short sentence."}
    conv = client.conversations.create(items=[system], metadata={"topic": "capitals"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "capitals"}
    ask = {"model": server.model, "temperature": 0, "max_output_tokens": 24}
    first = client.responses.create(**ask, conversation=conv.id, input=QUESTION)
    assert first.conversation.id == conv.id
    with client.responses.stream(**ask, conversation={"id": conv.id}, input="And Spain?") as s:
        second = s.get_final_response()
    whole = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And Spain?"},
    ]
    alone = client.responses.create(**ask, input=whole)
    assert second.output_text == alone.output_text and second.output_text
    assert second.usage.input_tokens == alone.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [(i.type, i.role, i.content[0].text, i.status) for i in items] == [
        ("message", "system", "Answer in one short sentence.", "completed"),
        ("message", "user", QUESTION, "completed"),
        ("message", "assistant", first.output_text, "completed"),
        ("message", "user", "And Spain?", "completed"),
        ("message", "assistant", second.output_text, "completed"),
    ]
    assert [i.id for i in items[2::2]] == [first.output[0].id, second.output[0].id]
    counted = client.responses.input_tokens.count(
        model=server.model, conversation=conv.id, input="And Italy?"
    )
    rest = [*whole, {"role": "assistant", "content": second.output_text}]
    sent = client.responses.input_tokens.count(
        model=server.model, input=[*rest, {"role": "user", "content": "And Italy?"}]
    )
    assert counted.input_tokens == sent.input_tokens
    # an item_reference to one of its items is that item
    again = client.responses.input_tokens.count(
        model=server.model,
        conversation=conv.id,
        input=[{"type": "item_reference", "id": items[1].id}],
    )
    sent = client.responses.input_tokens.count(
        model=server.model, input=[*rest, {"role": "user", "content": QUESTION}]
    )
    assert again.input_tokens == sent.input_tokens


def test_a_conversations_items_are_added_listed_and_deleted(server):
    """The calls an agent session makes: items added (ids given to them), listed a page at a
    time, the newest read and popped; the labels replaced; the conversation deleted, after
    which it and a response made with it are 404s."""
    client = server.client()
    r = server.http("POST", "/v1/conversations")  # no body at all: an empty conversation
    assert r.status_code == 200 and r.json()["object"] == "conversation"
    conv = client.conversations.retrieve(r.json()["id"])
    added = client.conversations.items.create(
        conv.id,
        items=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"role": "assistant", "content": "b"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "d"},
        ],
    )
    ids = [i.id for i in added.data]
    assert len(set(ids)) == 4 and (added.first_id, added.last_id) == (ids[0], ids[-1])
    page = client.conversations.items.list(conv.id, limit=3)  # newest first
    assert [i.id for i in page.data] == ids[::-1][:3] and page.has_more
    assert [i.id for i in page.get_next_page().data] == ids[:1]
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc")] == ids
    newest = client.conversations.items.retrieve(ids[-1], conversation_id=conv.id)
    assert (newest.type, newest.output) == ("function_call_output", "d")
    assert client.conversations.items.delete(ids[-1], conversation_id=conv.id).id == conv.id
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc")] == ids[:3]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(ids[-1], conversation_id=conv.id)
    renamed = client.conversations.update(conv.id, metadata={"user": "7"})
    assert renamed.metadata == client.conversations.retrieve(conv.id).metadata == {"user": "7"}
    assert client.conversations.delete(conv.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=server.model, conversation=conv.id, input="x")
    assert e.value.body["param"] == "conversation"
    assert e.value.body["message"] == (
        f"No conversation found with id '{conv.id}': this server keeps conversations until "
        "they are deleted"
    )


def test_a_change_that_cannot_be_written_is_not_made(server):
    """A conversation whose file went behind the server's back: adding to it is a 500
    that says why and the change is not made; the server goes on serving."""
    client = server.client()
    conv = client.conversations.create()
    path = server.log_path.parent / "conversations" / f"{conv.id}.jsonl"
    path.unlink()
    r = server.http(
        "POST",
        f"/v1/conversations/{conv.id}/items",
        json={"items": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "the conversation could not be written to its file: No such file or "
        f"directory ({path}); the change was not made",
        "type": "server_error",
        "param": None,
        "code": "conversation_write_failed",
    }
    assert list(client.conversations.items.list(conv.id)) == []
    assert not path.exists()  # no file made up in its place
    assert client.conversations.delete(conv.id).deleted is True


@pytest.mark.parametrize(
    ("method", "path", "body", "param", "message"),
    [
        (
            "POST",
            "/v1/responses",
            {
                "model": "smollm2-135m",
                "input": "x",
                "conversation": "c",
                "previous_response_id": "r",
            },
            "conversation",
            "previous_response_id and conversation cannot be used together: the conversation "
            "holds the turns before this one; send one of them",
        ),
        (
            "POST",
            "/v1/responses",
            {"model": "smollm2-135m", "input": "x", "conversation": 5},
            "conversation",
            "conversation must be a conversation id or {id}, got 5",
        ),
        (
            "POST",
            "/v1/conversations",
            {"items": [{"role": "robot", "content": "x"}]},
            "items[0].role",
            'items[0].role must be one of system, developer, user, assistant, got "robot"',
        ),
        (
            "POST",
            "/v1/conversations",
            {"items": [{"type": "item_reference", "id": "msg_1"}]},
            "items[0].type",
            "items[0]: item references are not taken here; send the item itself",
        ),
        (
            "POST",
            "/v1/conversations",
            {"items": "hello"},
            "items",
            "items must be a list of items",
        ),
        (
            "POST",
            "/v1/conversations",
            {"title": "x"},
            "title",
            "Unrecognized request argument supplied: title",
        ),
        (
            "POST",
            "/v1/conversations",
            {"metadata": {str(i): "x" for i in range(17)}},
            "metadata",
            "metadata must be an object of at most 16 keys",
        ),
        (
            "POST",
            "/v1/conversations/ID/items",
            {"items": []},
            "items",
            "items must be a list of one or more items to add",
        ),
        (
            "POST",
            "/v1/conversations/ID",
            {},
            "metadata",
            "metadata is required: the conversation's new labels",
        ),
        (
            "GET",
            "/v1/conversations/ID/items?limit=0",
            None,
            "limit",
            "limit must be an integer in [1, 100], got '0'",
        ),
        (
            "GET",
            "/v1/conversations/ID/items?after=msg_x",
            None,
            "after",
            'after names no item of this conversation: "msg_x"',
        ),
    ],
)
def test_bad_conversation_requests_get_a_400_naming_the_field(
    server, method, path, body, param, message
):
    conv = server.client().conversations.create()
    path = path.replace("ID", conv.id)
    r = httpx.request(method, f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["message"], error["type"], error["param"]) == (
        message,
        "invalid_request_error",
        param,
    )
    assert list(server.client().conversations.items.list(conv.id)) == []  # nothing added


@pytest.mark.slow  # three servers started
def test_conversations_and_stored_responses_outlive_the_server(tmp_path):
    """A conversation made on one server, with a turn answered in it, and a stored response
    are on the next server started on the same folders, item for item, and turns go on
    from them; a server started on the folders while another owns them keeps both in
    memory and says so."""
    folder = str(tmp_path / "conversations")
    kept = str(tmp_path / "responses")
    dirs = ("--conversation-dir", folder, "--responses-dir", kept)
    ask = {"model": "smollm2-135m", "temperature": 0, "max_output_tokens": 16}
    first = Server(tmp_path / "a", *dirs)
    try:
        client = first.client()
        conv = client.conversations.create(metadata={"topic": "capitals"})
        client.responses.create(**ask, conversation=conv.id, input=QUESTION)
        before = [i.model_dump() for i in client.conversations.items.list(conv.id, order="asc")]
        stored = client.responses.create(**ask, input=QUESTION)
        second = Server(tmp_path / "b", *dirs)
        code = second.stop()
        assert (
            f"mlxkv: conversations: {folder} is in use by another mlxkv server: this "
            "server keeps its conversations in memory only (give it a --conversation-dir of "
            "its own to keep them)\n" in second.log()
        )
        assert (
            f"mlxkv: responses: {kept} is in use by another mlxkv server: this server keeps "
            "its stored responses in memory only (give it a --responses-dir of its own to "
            "keep them)\n" in second.log()
        )
        assert code == 0
    finally:
        assert first.stop() == 0
    third = Server(tmp_path / "c", *dirs)
    try:
        assert f"mlxkv: conversations: 1 kept in {folder}" in third.log()
        assert f"mlxkv: responses: 2 kept in {kept}" in third.log()
        client = third.client()
        assert client.conversations.retrieve(conv.id).metadata == {"topic": "capitals"}
        after = [i.model_dump() for i in client.conversations.items.list(conv.id, order="asc")]
        assert after == before and len(after) == 2
        went_on = client.responses.create(**ask, conversation=conv.id, input="And Spain?")
        whole = [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": after[1]["content"][0]["text"]},
            {"role": "user", "content": "And Spain?"},
        ]
        alone = client.responses.create(**ask, input=whole)
        assert went_on.output_text == alone.output_text
        assert client.responses.retrieve(stored.id).model_dump() == stored.model_dump()
        chained = client.responses.create(**ask, previous_response_id=stored.id, input="And Spain?")
        assert chained.output_text == alone.output_text
    finally:
        assert third.stop() == 0


def test_a_stream_cut_by_shutdown_ends_with_an_error_event(server):
    """The last test of the default model's server: it stops it. A stream still running
    when the grace time ends gets the Responses error event, and the server exits 0."""
    body = {"model": "smollm2-135m", "max_output_tokens": 4000, "stream": True}
    body["input"] = "Count to ten thousand, one by one."
    lines = cut_by_shutdown(server, "/v1/responses", body, "event: response.output_text.delta")
    assert lines[-2] == "event: error"
    err = json.loads(lines[-1][len("data: ") :])
    assert (err["type"], err["code"], err["param"]) == ("error", "shutting_down", None)
    assert err["message"].startswith("the server is shutting down; this answer was cut")
    deltas = sum(line == "event: response.output_text.delta" for line in lines)
    assert err["sequence_number"] == len(lines) // 2 - 1 and deltas > 0


# -- a model that thinks and calls a tool --------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory, default_model_path):
    out = tmp_path_factory.mktemp("tool_model_responses")
    return out, scripted_model(out, default_model_path, SCRIPT, TEMPLATE, MARKERS)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, built):
    yield from serving(tmp_path_factory.mktemp("serve_responses_tools"), str(built[0]), "--force")


def test_reasoning_text_and_a_function_call_come_as_items(tool_server, built):
    folder, script = built
    c = tool_server.client()
    kw = {"model": tool_server.model, "max_output_tokens": 64, "input": ASK, "tools": [TOOL]}
    r = c.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    thought, said, call = r.output
    assert [p.text for p in thought.content] == [THOUGHT] and thought.summary == []
    assert said.content[0].text == "Checking."
    assert (call.name, json.loads(call.arguments), call.status) == (
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.usage.input_tokens == len(rendered(folder, ASK))
    assert r.usage.output_tokens == len(script) + 1
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens

    with c.responses.stream(**kw) as s:
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == THOUGHT
    assert json.loads(final.output[2].arguments) == {"city": "Paris"}

    ev = events(tool_server, {**kw, "stream": True})
    names = [n for n, _ in ev]
    assert "response.reasoning_text.delta" in names
    done = [d for n, d in ev if n == "response.function_call_arguments.done"]
    assert [(d["name"], json.loads(d["arguments"])) for d in done] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_the_function_call_output_turn_renders_as_the_template_does(tool_server, built):
    """The next turn, sent as items (the output again, or references to it, as Codex sends
    them, then the call's output) or as previous_response_id and the call's output alone:
    the same prompt, the messages the chat template reads, the turn before served by the
    prefix cache."""
    folder, _ = built
    c = tool_server.client()
    kw = {"model": tool_server.model, "max_output_tokens": 64, "tools": [TOOL]}
    first = c.responses.create(input=ASK, **kw)
    call = first.output[2]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    resent = c.responses.create(
        input=[*ASK, *[o.model_dump(exclude_none=True) for o in first.output], result], **kw
    )
    chained = c.responses.create(input=[result], previous_response_id=first.id, **kw)
    references = [{"type": "item_reference", "id": o.id} for o in first.output]
    referenced = c.responses.create(input=[*ASK, *references, result], **kw)
    expected = [
        *ASK,
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": THOUGHT,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "clear"}'},
    ]
    want = len(rendered(folder, expected))
    assert resent.usage.input_tokens == chained.usage.input_tokens == want
    assert referenced.usage.input_tokens == want
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_a_forced_function_call(tool_server):
    """tool_choice required (or one function by name) holds the answer to a call whose
    arguments match the tool's schema."""
    city = {
        **TOOL,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    c = tool_server.client()
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = c.responses.create(
            model=tool_server.model,
            max_output_tokens=64,
            input=ASK,
            tools=[city],
            tool_choice=choice,
            parallel_tool_calls=False,
        )
        assert [o.type for o in r.output] == ["function_call"]
        assert (r.output[0].name, json.loads(r.output[0].arguments)) == (
            "get_weather",
            {"city": "Paris"},
        )


def test_a_call_the_model_wrote_with_no_json_object_is_kept_as_written():
    """A stored answer goes on (previous_response_id) even where the model's call arguments
    are no JSON object; a client that sends such a call is told what to send."""
    from mlxkv.server.errors import APIError
    from mlxkv.server.responses import input_messages

    call = {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "[1"}
    kept = input_messages([call], written=True)
    assert kept == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}
            ],
        }
    ]
    with pytest.raises(APIError) as e:
        input_messages([call])
    assert e.value.param == "input[0].arguments"


# -- Codex's tools: a custom (freeform) tool beside OpenAI's hosted ones -------------------
PATCH_CALL = '{"name": "apply_patch","arguments": {"input":"*** Begin Patch"} }'
PATCH_SCRIPT = f"Patching.<tool_call>{PATCH_CALL}</tool_call>"
LARK = 'start: begin_patch\nbegin_patch: "*** Begin Patch"'
APPLY_PATCH = {  # as Codex sends it
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": LARK},
}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "local_shell"}]
# what the chat template is offered for APPLY_PATCH: a function of one string
APPLY_PATCH_FN = {
    "type": "function",
    "function": {
        "name": "apply_patch",
        "parameters": {
            "type": "object",
            "properties": {
                "input": {
                    "type": "string",
                    "description": f"Text matching this lark grammar:\n{LARK}",
                }
            },
            "required": ["input"],
        },
        "description": "Edit files with a patch.",
    },
}


@pytest.fixture(scope="module")
def patch_built(tmp_path_factory, default_model_path):
    out = tmp_path_factory.mktemp("patch_model")
    return out, scripted_model(out, default_model_path, PATCH_SCRIPT, TEMPLATE, MARKERS)


@pytest.fixture(scope="module")
def patch_server(tmp_path_factory, patch_built):
    yield from serving(tmp_path_factory.mktemp("serve_patch"), str(patch_built[0]), "--force")


def test_codex_custom_and_hosted_tools(patch_server, patch_built):
    """Codex's request: function and custom tools beside hosted ones, its client_metadata
    and a verbosity. The template is offered the function and the custom tool (as a
    function of one string), not the hosted tools; the model's call of the custom tool
    comes back as a custom_tool_call item, whole and streamed, and goes on as input."""
    folder, _ = patch_built
    body = {
        "model": patch_server.model,
        "max_output_tokens": 64,
        "input": ASK,
        "tools": [TOOL, APPLY_PATCH, *HOSTED],
        "client_metadata": {"x-codex-installation-id": "abc"},
        "text": {"verbosity": "low"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    r = post(patch_server, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["type"] for o in out["output"]] == ["message", "custom_tool_call"]
    call = out["output"][1]
    assert (call["name"], call["input"], call["status"]) == (
        "apply_patch",
        "*** Begin Patch",
        "completed",
    )
    assert call["call_id"].startswith("call_") and call["id"].startswith("ctc_")
    assert out["usage"]["input_tokens"] == len(
        rendered(folder, ASK, tools=(WEATHER, APPLY_PATCH_FN))
    )
    assert [t["type"] for t in out["tools"]] == ["function", "custom", "web_search", "local_shell"]
    assert out["tools"][1]["format"] == APPLY_PATCH["format"]
    assert out["text"]["verbosity"] == "low"

    ev = events(patch_server, {**body, "stream": True})
    names = [n for n, _ in ev]
    assert names[-1] == "response.completed"
    assert [d["delta"] for n, d in ev if n == "response.custom_tool_call_input.delta"] == [
        "*** Begin Patch"
    ]
    done = [d["item"] for n, d in ev if n == "response.output_item.done"]
    assert [(i["type"], i.get("input")) for i in done] == [
        ("message", None),
        ("custom_tool_call", "*** Begin Patch"),
    ]

    # the next turn: the call and its output as input items, as Codex sends them
    result = {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done"}
    turn = {**body, "input": [*ASK, *out["output"], result]}
    expected = [
        *ASK,
        {
            "role": "assistant",
            "content": "Patching.",
            "tool_calls": [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["call_id"], "content": "Done"},
    ]
    r = post(patch_server, turn)
    assert r.status_code == 200, r.text
    want = len(rendered(folder, expected, tools=(WEATHER, APPLY_PATCH_FN)))
    assert r.json()["usage"]["input_tokens"] == want
