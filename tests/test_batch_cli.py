"""``mlxkv batch`` end to end: bad input, exit codes, duplicates, resume after a kill.

Runs in process through ``mlxkv.cli.main``; the model-backed tests reuse the session's
loaded default model instead of loading it for every run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mlxkv.cli import main
from tests.batch_files import read_records, write_lines


# -- the whole run cannot proceed: exit 2, one line, nothing written ---------------------------
@pytest.mark.parametrize(
    "setup, words",
    [
        (lambda d: d / "missing.jsonl", "does not exist"),
        (lambda d: write_lines(d / "empty.jsonl", [""]), "is empty"),
        (lambda d: write_lines(d / "prose.jsonl", ["Dear reader,", "hello"]), "not JSONL"),
    ],
)
def test_unusable_input_exits_2(tmp_path, capsys, no_model, setup, words):
    inp = setup(tmp_path)
    assert main(["batch", str(inp), "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and err[0].startswith("mlxkv batch: error:")
    assert not (tmp_path / "out.jsonl").exists()


def test_output_in_missing_directory_exits_2(tmp_path, capsys, no_model):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    assert main(["batch", str(inp), "-o", str(tmp_path / "nope" / "out.jsonl")]) == 2
    assert "output directory" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()


def test_output_is_input_exits_2(tmp_path, capsys, no_model):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    assert main(["batch", str(inp), "-o", str(inp)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert json.loads(inp.read_text()) == {"id": 1, "prompt": "hi"}


def test_bad_batch_size_exits_2(tmp_path, capsys, no_model):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    assert main(["batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err


def test_foreign_output_file_is_refused_untouched(tmp_path, capsys, no_model):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    assert main(["batch", str(inp), "-o", str(out)]) == 2
    assert "not a batch record" in capsys.readouterr().err
    assert out.read_text() == "precious\n"


# -- only bad lines: error records, exit 1, no model load, resume adds nothing ---------------
def test_bad_lines_become_records_without_loading(tmp_path, capsys, no_model):
    inp = write_lines(
        tmp_path / "in.jsonl",
        ["{oops", {"id": "a"}, {"id": "b", "prompt": "x", "colour": 1}, {"id": "a"}],
    )
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out), "--stats"]) == 1
    cap = capsys.readouterr()
    recs = read_records(out)
    assert [r["line"] for r in recs] == [1, 2, 3, 4]
    assert all("error" in r for r in recs)
    assert "id" not in recs[0] and recs[1]["id"] == "a"
    assert "duplicate id 'a'" in recs[3]["error"] and "line 2" in recs[3]["error"]
    assert "duplicate id 'a' on line 4" in cap.err
    assert json.loads(cap.out)["errors"] == 4
    before = out.read_bytes()
    # All done, nothing to redo, but the output still answers lines with errors: exit 1.
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    assert out.read_bytes() == before
    assert "4 lines already in" in capsys.readouterr().err


# -- with the model -----------------------------------------------------------------------------
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "Name a large animal.",
]


@pytest.mark.model
def test_mixed_input_end_to_end(tmp_path, capsys, preloaded):
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "fr", "prompt": QUESTIONS[0], "max_tokens": 12},
            "not json",
            {"id": 2, "messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 4},
            {"id": "fr", "prompt": "again"},
            {"id": "sys", "prompt": QUESTIONS[1], "system": "Be brief.", "max_tokens": 6},
            {"id": "long", "prompt": "word " * 9000, "max_tokens": 4},
        ],
    )
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out), "--batch-size", "2", "--stats"]) == 1
    cap = capsys.readouterr()
    by_line = {r["line"]: r for r in read_records(out)}
    assert sorted(by_line) == [1, 2, 3, 4, 5, 6]
    assert "Paris" in by_line[1]["text"] and by_line[1]["id"] == "fr"
    for line in (1, 3, 5):
        r = by_line[line]
        assert r["finish_reason"] in ("stop", "length")
        assert r["prompt_tokens"] > 0 and 0 < r["generation_tokens"] <= 12
        assert r["latency_s"] > 0
    assert by_line[3]["generation_tokens"] <= 4 and by_line[3]["id"] == 2
    assert "error" in by_line[2] and "duplicate" in by_line[4]["error"]
    assert "model's context is 8192" in by_line[6]["error"] and by_line[6]["id"] == "long"
    stats = json.loads(cap.out)
    assert stats["results"] == 3 and stats["errors"] == 3 and stats["batched"] is True
    assert stats["generation_tokens"] == sum(by_line[i]["generation_tokens"] for i in (1, 3, 5))


@pytest.mark.model
def test_resume_after_a_torn_write(tmp_path, capsys, preloaded):
    """Simulated kill: the output ends mid-record. The re-run cuts the torn line, redoes
    that one result, keeps the others byte for byte and writes each id exactly once."""
    lines = [{"id": f"q{i}", "prompt": q, "max_tokens": 8} for i, q in enumerate(QUESTIONS)]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out), "--batch-size", "3"]) == 0
    full = read_records(out)
    kept = out.read_text().splitlines(keepends=True)[:2]
    torn = out.read_text().splitlines(keepends=True)[2][:25]
    out.write_text("".join(kept) + torn)
    capsys.readouterr()

    assert main(["batch", str(inp), "-o", str(out), "--batch-size", "3"]) == 0
    err = capsys.readouterr().err
    assert "torn last line" in err and "2 lines already in" in err
    text = out.read_text()
    assert text.startswith("".join(kept))
    again = read_records(out)
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in full)
    # Greedy: the redone results equal the first run's.
    strip = {"latency_s", "prompt_tps", "generation_tps"}

    def same(r):
        return {k: v for k, v in r.items() if k not in strip}

    assert sorted(map(json.dumps, map(same, again))) == sorted(map(json.dumps, map(same, full)))


@pytest.mark.model
@pytest.mark.parametrize(
    "flags", [["--kv-window", "64", "--kv-sinks", "4"], ["--kv-bits", "4"]], ids=" ".join
)
def test_bounded_and_quantized_policies_run_batched(tmp_path, capsys, preloaded, flags):
    """No "one by one" fallback; --stats puts the batch's KV bytes next to the prediction."""
    lines = [{"id": i, "prompt": q, "max_tokens": 6} for i, q in enumerate(QUESTIONS[:2])]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out), "--stats", *flags]) == 0
    cap = capsys.readouterr()
    assert "one by one" not in cap.err and "batch size 16" in cap.err
    stats = json.loads(cap.out)
    assert stats["batched"] is True
    assert stats["kv_bytes_actual_peak"] == stats["kv_bytes_predicted_peak"] > 0
    assert stats["kv_steps_mismatched"] == 0
    assert all(r["generation_tokens"] > 0 for r in read_records(out))


@pytest.mark.model
def test_raw_prompts_continue_their_text_and_chat_answers_do_not_start_with_a_space(
    tmp_path, preloaded
):
    """--raw: a 'prompt' line's text is what its tokens add to it (" Paris" after "... is");
    a 'messages' line is a chat message either way."""
    lines = [
        {"id": "raw", "prompt": "The capital of France is", "max_tokens": 2},
        {"id": "chat", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 2},
    ]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out), "--raw"]) == 0
    texts = {r["id"]: r["text"] for r in read_records(out)}
    assert texts == {"raw": " Paris.", "chat": "The capital"}


@pytest.mark.model
def test_json_schema_for_the_run_answers_every_line_in_it_and_is_in_the_fingerprint(
    tmp_path, capsys, preloaded
):
    """--json-schema holds every line's answer to the schema; a run without it and one
    with another schema are different runs (their lines run again), and a run with the
    same schema resumes."""
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"answer": {"type": "string",
                                  "maxLength": 30}}, "required": ["answer"],
                                  "additionalProperties": False}))  # fmt: skip
    inp = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": q} for i, q in enumerate(
        QUESTIONS[:2])])  # fmt: skip
    out = tmp_path / "out.jsonl"
    run = ["batch", str(inp), "-o", str(out), "--max-tokens", "40"]
    assert main([*run, "--json-schema", str(schema)]) == 0
    recs = read_records(out)
    assert len(recs) == 2
    for r in recs:
        assert r["finish_reason"] == "stop" and set(json.loads(r["text"])) == {"answer"}
    assert main([*run, "--json-schema", str(schema)]) == 0
    assert len(read_records(out)) == 2  # resumed: nothing ran again
    assert main(run) == 0
    free = read_records(out)[2:]
    assert len(free) == 2 and all(not r["text"].startswith("{") for r in free)


@pytest.mark.model
def test_a_line_with_a_json_schema_answers_in_it(tmp_path, preloaded):
    """'json_schema' holds that line's answer to the schema; a schema that cannot be used
    is that line's error record; the other lines answer as before."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "capital": {"type": "boolean"}},
        "required": ["city", "capital"],
        "additionalProperties": False,
    }
    ask = {"role": "user", "content": QUESTIONS[0] + " Answer in JSON."}
    lines = [
        {"id": "json", "messages": [ask], "max_tokens": 40, "json_schema": schema},
        {"id": "free", "messages": [ask], "max_tokens": 40},
        {"id": "bad", "prompt": "x", "json_schema": {"type": "nonsense"}},
        {"id": "list", "prompt": "x", "json_schema": ["object"]},
    ]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    recs = {r["id"]: r for r in read_records(out)}
    assert recs["json"]["finish_reason"] == "stop"
    answer = json.loads(recs["json"]["text"])
    assert set(answer) == {"city", "capital"} and isinstance(answer["capital"], bool)
    assert recs["free"]["text"] == '{"city": "Paris"}'  # free: no "capital"
    assert recs["bad"]["error"] == (
        "'json_schema': the JSON schema cannot be used: Invalid type: nonsense"
    )
    assert recs["list"]["error"] == (
        "'json_schema' must be a JSON Schema object ({} for any JSON value)"
    )


@pytest.mark.model
def test_lines_of_a_set_length_hold_their_end_back(tmp_path, preloaded):
    """A line's ignore_eos runs its answer to max_tokens, its min_tokens past its EOS (an
    OpenAI batch body's too, as vLLM's runner takes them); with a json_schema either is
    that line's error record."""
    ask = [{"role": "user", "content": "Reply with one word: is the sky blue?"}]
    body = {"messages": ask, "max_tokens": 16, "ignore_eos": True}
    lines = [
        {"id": "plain", "messages": ask, "max_tokens": 16},
        {"id": "long", "messages": ask, "max_tokens": 16, "ignore_eos": True},
        {"id": "more", "messages": ask, "max_tokens": 16, "min_tokens": 12},
        {"custom_id": "openai", "method": "POST", "url": "/v1/chat/completions", "body": body},
        {"id": "held", "messages": ask, "ignore_eos": True, "json_schema": {}},
        {"id": "typed", "messages": ask, "min_tokens": "12"},
    ]
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(write_lines(tmp_path / "in.jsonl", lines)), "-o", str(out)]) == 1
    recs = {r.get("custom_id") or r["id"]: r for r in read_records(out)}
    assert (recs["plain"]["finish_reason"], recs["plain"]["generation_tokens"]) == ("stop", 9)
    assert (recs["long"]["finish_reason"], recs["long"]["generation_tokens"]) == ("length", 16)
    assert recs["long"]["text"].startswith(recs["plain"]["text"])
    assert recs["more"]["generation_tokens"] > 12
    assert recs["openai"]["response"]["body"]["usage"]["completion_tokens"] == 16
    assert recs["held"]["error"] == (
        "'ignore_eos' cannot go with 'json_schema': that answer ends where its schema does"
    )
    assert recs["typed"]["error"] == "'min_tokens' must be an integer >= 0, got '12'"


@pytest.mark.model
@pytest.mark.slow
def test_kill_9_then_resume(tmp_path, default_model_path):
    """A real ``mlxkv batch`` process killed -9 mid-run; the re-run completes the file with
    every id exactly once."""
    lines = [
        {"id": i, "prompt": f"Write a short poem about the number {i}.", "max_tokens": 24}
        for i in range(12)
    ]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "mlxkv", "batch", str(inp), "-o", str(out), "--batch-size", "4"]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < 2):
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(read_records(out)) if out.read_bytes().endswith(b"\n") else None
    assert subprocess.run(cmd, capture_output=True, timeout=900).returncode == 0
    recs = read_records(out)
    assert sorted(r["id"] for r in recs) == list(range(12))
    assert all("text" in r for r in recs)
    if done_before is not None:
        assert done_before >= 2


@pytest.mark.model
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_run_saying_which_records_are_safe(tmp_path, default_model_path, sig):
    """SIGTERM (timeout, systemd, schedulers) ended the run with 143 and not a word."""
    lines = [{"id": i, "prompt": "Write a long story about a dragon."} for i in range(2)]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "mlxkv", "batch", str(inp), "-o", str(out), "--batch-size", "1"]
    cmd += ["--max-tokens", "4000", "--no-progress"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    err = ""
    while "2 prompts, batch size 1" not in err:  # the model is loaded and running
        line = proc.stderr.readline()
        assert line, err
        err += line
    proc.send_signal(sig)
    err += proc.stderr.read()
    assert proc.wait(120) == 130
    assert err.endswith(
        f"mlxkv: interrupted: 0 records are safe in {out}; re-run to resume\n"
        "mlxkv batch: interrupted\n"
    )


# -- prompt text: template, system prompts, --raw ---------------------------------------------
class _EchoTemplate:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def test_prompt_text_system_rules():
    from types import SimpleNamespace

    from mlxkv.commands.batch import _prompt_text
    from mlxkv.commands.batch_input import parse_line
    from mlxkv.errors import UserError

    tok = _EchoTemplate()
    flags = SimpleNamespace(raw=False, system="S")
    job = parse_line(1, '{"id": 1, "prompt": "q"}')
    assert _prompt_text(job, tok, flags) == "system:S|user:q"
    own = parse_line(1, '{"id": 1, "prompt": "q", "system": "mine"}')
    assert _prompt_text(own, tok, flags) == "system:mine|user:q"
    msgs = '[{"role": "system", "content": "M"}, {"role": "user", "content": "q"}]'
    has = parse_line(1, '{"id": 1, "messages": ' + msgs + "}")
    assert _prompt_text(has, tok, flags) == "system:M|user:q"  # --system only fills in
    both = parse_line(1, '{"id": 1, "system": "x", "messages": ' + msgs + "}")
    with pytest.raises(UserError, match="both 'system'"):
        _prompt_text(both, tok, flags)
    raw = SimpleNamespace(raw=True, system="")
    assert _prompt_text(job, tok, raw) == "q"
    with pytest.raises(UserError, match="needs the chat template"):
        _prompt_text(own, tok, raw)


def test_fingerprints_of_files_written_before_stay_the_same():
    """The run context of a chat batch is byte for byte what earlier versions wrote into
    every record's fingerprint (settings a batch cannot set are left out), so their files
    resume; a raw batch's differs, its lines' text now keeping their first space."""
    from types import SimpleNamespace

    from mlxkv.commands.batch import _run_context
    from mlxkv.engine.request import GenerationSettings
    from mlxkv.policy import KVPolicy

    args = SimpleNamespace(model="smollm2-135m", dtype="auto", system="", raw=False)
    assert _run_context(args, KVPolicy(), GenerationSettings()) == (
        '{"dtype": "auto", "model": "smollm2-135m", "policy": {"bits": null, "group_size": 64, '
        '"key_bits": null, "key_scheme": "kivi", "sinks": 0, "value_bits": null, '
        '"value_group_size": 64, "window": null}, "raw": false, "settings": {"max_tokens": 512, '
        '"min_p": 0.0, "repetition_penalty": null, "seed": null, "stop": [], "temperature": '
        '0.0, "top_k": 0, "top_p": 1.0}, "system": ""}'
    )
    raw = SimpleNamespace(model="smollm2-135m", dtype="auto", system="", raw=True)
    assert '"raw": "continuation"' in _run_context(raw, KVPolicy(), GenerationSettings())


# -- OpenAI Batch API request lines -------------------------------------------------------------
def _openai_line(custom_id, body, **line):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": body, **line}  # fmt: skip


def test_openai_batch_lines_read_as_the_files_own_fields():
    from mlxkv.commands.batch_input import BadLine, Job, parse_line

    body = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be "},
                                              {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "Hi"},
        ],
        "max_completion_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": "\n\n",
        "logprobs": None,  # null is "not given", as OpenAI's clients send it
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "object"}}},
    }  # fmt: skip
    line = _openai_line("req-1", body)
    job = parse_line(4, json.dumps(line))
    assert isinstance(job, Job)
    assert (job.line, job.id, job.prompt, job.system) == (4, "req-1", None, None)
    assert job.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert {k: v for k, v in job.overrides.items() if k != "grammar"} == {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": ("\n\n",),
    }
    assert job.overrides["grammar"] is not None
    assert job.source == line  # the fingerprint is of the line as written

    def error(line) -> tuple:
        bad = parse_line(1, json.dumps(line))
        assert isinstance(bad, BadLine)
        return bad.id, bad.error

    user = [{"role": "user", "content": "Hi"}]
    assert error(_openai_line("a", {"messages": user}, url="/v1/responses")) == (
        "a",
        "'url' '/v1/responses': /v1/chat/completions and /v1/embeddings requests run in "
        "mlxkv batch",
    )
    assert error(_openai_line("e", {"messages": user}, url="/v1/embeddings")) == (
        "e",
        "body: Unrecognized request argument supplied: messages",
    )
    assert error(_openai_line("b", {"messages": user, "n": 2})) == (
        "b",
        "body.n is not supported in mlxkv batch; it takes model, messages, max_tokens, "
        "max_completion_tokens, temperature, top_p, seed, stop, response_format, min_tokens, "
        "ignore_eos",
    )
    assert error(_openai_line("c", {"model": "m"})) == (
        "c",
        "body.messages is required: the conversation to answer",
    )
    two = {"messages": user, "max_tokens": [1], "max_completion_tokens": 2}
    assert error(_openai_line("d", two)) == (
        "d",
        "body.max_tokens and body.max_completion_tokens disagree; give one",
    )
    assert error(_openai_line("e", {"messages": user}, method="GET")) == (
        "e",
        "'method' must be \"POST\", got 'GET'",
    )
    assert error(_openai_line("f", {"messages": user}, extra=1)) == (
        "f",
        "unknown field(s) extra in an OpenAI batch request line",
    )
    assert error(_openai_line("g", {"messages": user, "response_format": {"type": "xml"}})) == (
        "g",
        'body.response_format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"schema": ...}}',
    )
    assert error(_openai_line(None, {"messages": user})) == (
        None,
        "'custom_id' must be a string or an integer, got None",
    )
    for stop in ("", [], ["x", ""], ["x"] * 65, 5):
        assert error(_openai_line("s", {"messages": user, "stop": stop})) == (
            "s",
            "'stop' must be a string or a list of 1 to 64 strings, none empty",
        )
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert error(_openai_line("h", {"messages": image}))[1].startswith(
        "'messages' has message 0 that is not"
    )


@pytest.mark.model
def test_an_openai_batch_file_answers_as_the_same_lines_in_mlxkvs_own_form(
    tmp_path, capsys, preloaded
):
    """The same three requests written as OpenAI Batch API lines and as this file's own
    lines: the same answers, token for token; the OpenAI lines' records in the shape of
    OpenAI's batch output (custom_id, response.body a chat.completion as the openai client
    reads it), a line that cannot run an error object; a re-run resumes from them."""
    from openai.types.chat import ChatCompletion

    asks = [
        ("fr", QUESTIONS[0], {"max_tokens": 12, "stop": ["Paris", "paris"]}),
        ("sum", QUESTIONS[2], {"max_completion_tokens": 6, "seed": 1, "temperature": 0.7}),
        ("json", QUESTIONS[4], {"max_tokens": 16, "response_format": {"type": "json_object"}}),
    ]
    openai_lines, own_lines = [], []
    for cid, question, extra in asks:
        messages = [{"role": "user", "content": question}]
        openai_lines.append(
            _openai_line(cid, {"model": "gpt-4o-mini", "messages": messages, **extra})
        )
        own = {
            "id": cid,
            "messages": messages,
            "max_tokens": extra.get("max_tokens") or extra["max_completion_tokens"],
        }
        own |= {k: extra[k] for k in ("seed", "temperature", "stop") if k in extra}
        own |= {"json_schema": {"type": "object"}} if "response_format" in extra else {}
        own_lines.append(own)
    own_out = tmp_path / "own.out.jsonl"
    assert main(["batch", str(write_lines(tmp_path / "own.jsonl", own_lines)),
                 "-o", str(own_out), "--temp", "0"]) == 0  # fmt: skip
    own = {r["id"]: r for r in read_records(own_out)}
    assert own["fr"]["text"] == "The capital of France is "
    assert own["fr"]["finish_reason"] == "stop_string"

    bad = _openai_line("embed", {"input": "hi"}, url="/v1/responses")
    inp = write_lines(tmp_path / "openai.jsonl", [*openai_lines, bad])
    out = tmp_path / "openai.out.jsonl"
    capsys.readouterr()
    assert main(["batch", str(inp), "-o", str(out), "--temp", "0"]) == 1
    assert "mlxkv: OpenAI lines name 'gpt-4o-mini'; smollm2-135m answers them\n" in (
        capsys.readouterr().err
    )
    recs = {r["custom_id"]: r for r in read_records(out)}
    assert sorted(recs) == ["embed", "fr", "json", "sum"]
    for line, (cid, _, _) in enumerate(asks, 1):
        rec = recs[cid]
        assert list(rec) == ["id", "line", "custom_id", "response", "error", "fp"]
        assert rec["id"].startswith("batch_req_") and rec["line"] == line
        assert rec["error"] is None and rec["response"]["status_code"] == 200
        answer = ChatCompletion.model_validate(rec["response"]["body"])
        assert answer.model == "smollm2-135m"
        (choice,) = answer.choices
        assert choice.message.content == own[cid]["text"]
        mine = own[cid]["finish_reason"]
        assert choice.finish_reason == {"stop_string": "stop"}.get(mine, mine)
        assert answer.usage.completion_tokens == own[cid]["generation_tokens"]
        assert answer.usage.prompt_tokens == own[cid]["prompt_tokens"]
    assert recs["embed"]["response"] is None and recs["embed"]["line"] == 4
    assert recs["embed"]["error"] == {
        "code": "invalid_request",
        "message": "'url' '/v1/responses': /v1/chat/completions and /v1/embeddings requests "
        "run in mlxkv batch",
    }
    before = out.read_bytes()
    assert main(["batch", str(inp), "-o", str(out), "--temp", "0"]) == 1
    assert out.read_bytes() == before


@pytest.mark.model
def test_openai_embeddings_lines_answer_each_inputs_vector(tmp_path, preloaded, default_model):
    """An OpenAI batch line for /v1/embeddings answers OpenAI's embeddings list: each
    input's last-token hidden state made unit length (a text or token ids; dimensions and
    base64 as asked), beside chat lines; a bad body and an id outside the vocabulary are
    that line's error record; a re-run runs nothing again."""
    import base64
    import math
    import struct

    import mlx.core as mx

    def unit_last(ids, dims=None):
        h = default_model.model.model(mx.array(ids)[None])[0, -1].astype(mx.float32).tolist()
        h = h[:dims] if dims else h
        norm = math.sqrt(sum(x * x for x in h))
        return [x / norm for x in h]

    def line(custom_id, body):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}

    tok = default_model.tokenizer
    text = "The capital of France is Paris."
    ids = tok.encode("hello", add_special_tokens=True)
    lines = [
        line("two", {"model": "text-embedding-3-small", "input": [text, ids]}),
        line("cut", {"input": text, "dimensions": 32, "encoding_format": "base64"}),
        line("empty", {"input": ""}),
        line("far", {"input": [[1, 2], [3, 99999]]}),
        _openai_line("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    ]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    recs = {r["custom_id"]: r for r in read_records(out)}
    from openai.types import CreateEmbeddingResponse

    body = recs["two"]["response"]["body"]
    assert CreateEmbeddingResponse.model_validate(body).model == "smollm2-135m"
    assert [d["index"] for d in body["data"]] == [0, 1] and body["object"] == "list"
    want = [unit_last(tok.encode(text, add_special_tokens=True)), unit_last(ids)]
    for d, w in zip(body["data"], want, strict=True):
        assert d["embedding"] == pytest.approx(w, abs=1e-4)
    assert body["usage"]["prompt_tokens"] == len(tok.encode(text)) + len(ids)
    packed = base64.b64decode(recs["cut"]["response"]["body"]["data"][0]["embedding"])
    got = list(struct.unpack("<32f", packed))
    assert got == pytest.approx(unit_last(tok.encode(text, add_special_tokens=True), 32), abs=1e-4)
    assert recs["empty"]["error"]["message"] == "body: input is empty"
    assert recs["far"]["error"]["message"] == (
        "input 1 holds token id 99999, outside the vocabulary [0, 49152)"
    )
    assert recs["chat"]["response"]["body"]["object"] == "chat.completion"
    before = out.read_bytes()
    assert main(["batch", str(inp), "-o", str(out)]) == 1  # the error records stand
    assert out.read_bytes() == before


@pytest.mark.model
def test_own_input_lines_answer_the_same_vectors(tmp_path, preloaded, default_model):
    """A line {"id", "input", "dimensions"?} answers {"embeddings": [...], "prompt_tokens"}:
    the vectors of the same OpenAI line; a line that mixes 'input' with a prompt, or an
    empty input, is its error record; a re-run reads the records back and runs nothing."""
    text = "The capital of France is Paris."
    ids = default_model.tokenizer.encode("hello", add_special_tokens=True)
    body = {"input": [text, ids]}
    lines = [
        {"id": "own", "input": [text, ids]},
        {"custom_id": "openai", "method": "POST", "url": "/v1/embeddings", "body": body},
        {"id": "cut", "input": text, "dimensions": 32},
        {"id": "mixed", "input": text, "prompt": "hi"},
        {"id": "empty", "input": ""},
    ]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    recs = {r.get("custom_id", r["id"]): r for r in read_records(out)}
    own, openai = recs["own"], recs["openai"]["response"]["body"]
    assert list(own) == ["id", "line", "embeddings", "prompt_tokens", "fp"]
    # inputs that share a model call round in other orders: unit vectors agree to 1e-6
    for mine, theirs in zip(own["embeddings"], openai["data"], strict=True):
        assert mine == pytest.approx(theirs["embedding"], abs=1e-6)
    assert own["prompt_tokens"] == openai["usage"]["prompt_tokens"]
    assert len(recs["cut"]["embeddings"][0]) == 32
    assert recs["mixed"]["error"] == "an 'input' line takes id, input, dimensions; not prompt"
    assert recs["empty"]["error"] == "input is empty"
    before = out.read_bytes()
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    assert out.read_bytes() == before
