"""The Responses API's ``truncation: "auto"``: the cut itself (``fitted``), counted with the
default model's own tokenizer and chat template, then a real server whose model has a short
context, spoken to by the official ``openai`` client."""

from __future__ import annotations

import json
import os
import shutil
from itertools import pairwise

import httpx
import pytest

from mlxkv.server.truncation import answer_room, fitted
from tests.serve_helpers import serving

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}


def turn(i: int) -> list[dict]:
    """A user question and its answer, about 70 tokens together."""
    return [
        {
            "role": "user",
            "content": f"Question {i}: " + "tell me about the river and the hills " * 4,
        },
        {"role": "assistant", "content": f"Answer {i}: " + "the river runs past the hills " * 4},
    ]


def talk(turns: int) -> list[dict]:
    msgs = [SYSTEM]
    for i in range(turns):
        msgs += turn(i)
    return msgs + [{"role": "user", "content": f"Question {turns}: and now?"}]


@pytest.fixture(scope="module")
def count(default_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_path))

    def count(messages: list[dict], whole: bool) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=whole)
        return len(tok.encode(text, add_special_tokens=False))

    return count


def test_a_conversation_that_fits_is_kept_whole(count):
    msgs = talk(3)
    assert fitted(msgs, count, count(msgs, True)) is msgs


def test_the_oldest_turns_go_and_the_instructions_stay(count):
    msgs = talk(20)
    room = 600
    kept = fitted(msgs, count, room)
    assert kept[0] == SYSTEM and kept[-1] == msgs[-1]
    assert kept[1]["role"] == "user" and kept[1:] == msgs[len(msgs) - len(kept) + 1 :]
    assert count(kept, True) <= room
    # a quarter of the room is the grain: what was dropped is less than a grain too much
    one_more = [SYSTEM] + msgs[len(msgs) - len(kept) - 1 :]
    assert count(one_more, True) > room - room // 4 - 80


def test_the_cut_stays_put_while_turns_are_added(count):
    """The kept conversations of consecutive turns share their start (the prefix cache
    reads it once); a cut of just enough tokens moves every turn."""
    room = 600
    starts, tight = [], []
    for n in range(12, 24):
        msgs = talk(n)
        starts.append(fitted(msgs, count, room)[1]["content"])
        tight.append(fitted(msgs, count, room, grains=room)[1]["content"])
    # each turn adds about 77 tokens, a grain is 150: the cut moves every other turn
    assert sum(a == b for a, b in pairwise(starts)) >= 4, starts
    assert sum(a == b for a, b in pairwise(tight)) == 0, tight


def test_a_function_call_keeps_its_output(count):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [SYSTEM] + turn(0) + turn(1)
    msgs += [
        {"role": "user", "content": "Question 2: call f"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "the hills " * 30},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "thanks"},
    ]
    room = count([SYSTEM] + msgs[5:], True)  # the call's turn and the last one fit
    kept = fitted(msgs, count, room, grains=room)
    assert kept == [SYSTEM] + msgs[5:]


def test_a_long_last_turn_is_kept_when_no_turn_starts_a_grain_in(count):
    msgs = [SYSTEM] + turn(0) + [{"role": "user", "content": "hills " * 400}]
    room = count([SYSTEM, msgs[-1]], True) + 5  # the grain is far more than the first turn
    assert fitted(msgs, count, room) == [SYSTEM, msgs[-1]]


def test_nothing_fits_when_the_last_turn_alone_is_too_long(count):
    msgs = talk(4)
    assert fitted(msgs, count, count([SYSTEM, msgs[-1]], True) - 1) is None


def test_the_answer_keeps_its_room_up_to_half_the_context():
    assert answer_room(100, 8192) == 100
    assert answer_room(100_000, 8192) == 4096


# -- a real server whose model has a 512-token context -------------------------------------
CONTEXT = 512


@pytest.fixture(scope="module")
def short(tmp_path_factory, default_model_path):
    out = tmp_path_factory.mktemp("short_context_model")
    for f in default_model_path.iterdir():
        if f.name != "config.json":
            os.symlink(f, out / f.name) if f.suffix == ".safetensors" else shutil.copy(f, out)
    config = json.loads((default_model_path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, short):
    # a token count (input_tokens) leaves the answer the server's --max-tokens
    yield from serving(tmp_path_factory.mktemp("serve_truncation"), str(short), "--max-tokens", "8")


def items(msgs: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in msgs[1:]]


def test_auto_truncation_answers_what_the_kept_turns_would_get(server):
    c = server.client()
    model = c.models.list().data[0].id
    msgs = talk(10)
    ask = {"model": model, "instructions": SYSTEM["content"], "max_output_tokens": 8}
    ask |= {"temperature": 0}
    r = httpx.post(f"{server.url}/v1/responses", json={**ask, "input": items(msgs)}, timeout=600)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"

    whole = c.responses.create(**ask, input=items(msgs), truncation="auto")
    assert whole.truncation == "auto" and whole.output_text
    n = whole.usage.input_tokens
    assert n <= CONTEXT - 8
    # the kept turns: the suffix starting at a user message whose count is n
    for cut in range(1, len(msgs), 2):
        counted = c.responses.input_tokens.count(
            model=model, instructions=SYSTEM["content"], input=items([SYSTEM] + msgs[cut:])
        )
        if counted.input_tokens == n:
            break
    else:
        raise AssertionError(f"no suffix of the conversation has {n} tokens")
    assert cut > 1
    kept = c.responses.create(**ask, input=items([SYSTEM] + msgs[cut:]))
    assert kept.output_text == whole.output_text
    assert kept.usage.input_tokens == n
    counted = c.responses.input_tokens.count(
        model=model, instructions=SYSTEM["content"], input=items(msgs), truncation="auto"
    )
    assert counted.input_tokens == n


@pytest.mark.slow  # 13 s alone, up to 45 s beside another worker on two cores
def test_a_long_chain_goes_on_with_its_prefix_cached(server):
    """previous_response_id chains past the context: each turn is answered within it, and
    a turn that keeps the last one's cut reads only what is new."""
    c = server.client()
    ask = {
        "model": c.models.list().data[0].id,
        "instructions": SYSTEM["content"],
        "max_output_tokens": 8,
    }
    ask |= {"temperature": 0, "truncation": "auto"}
    previous, seen = None, []
    for i in range(7):  # about 90 tokens a turn: the first cut comes at the sixth
        said = f"Question {i}: " + "tell me about the river and the hills " * 8
        r = c.responses.create(**ask, input=said, previous_response_id=previous)
        assert r.output_text and r.usage.input_tokens <= CONTEXT - 8
        previous = r.id
        seen.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
    grew = [i for i in range(1, 7) if seen[i][0] > seen[i - 1][0]]
    cut = [i for i in range(1, 7) if seen[i][0] < seen[i - 1][0]]
    assert cut, seen  # the chain went past the context
    # after the first cut, a turn that kept the cut read its prompt mostly from the cache
    assert any(i > cut[0] and seen[i][1] > seen[i][0] // 2 for i in grew), seen


def test_a_last_turn_too_long_for_the_context_is_refused(server):
    r = httpx.post(
        f"{server.url}/v1/responses",
        json={"input": "hills " * 600, "truncation": "auto", "max_output_tokens": 8},
        timeout=600,
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "input")
    assert err["message"] == (
        "even the input's last turn does not fit the model's context (512 tokens) with room "
        "for the answer (8): shorten it or send a smaller max_output_tokens"
    )
