"""Batch input parsing and the resumable output log: no model needed."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxkv.commands.batch_input import BadLine, Job, find_duplicates, parse_line, read_input
from mlxkv.commands.batch_output import ResultLog
from mlxkv.errors import UserError
from tests.batch_files import read_records


# -- input lines -------------------------------------------------------------------------------
def test_prompt_line_with_overrides():
    job = parse_line(
        3, '{"id": "a", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "seed": 1}'
    )
    assert isinstance(job, Job)
    assert (job.line, job.id, job.prompt) == (3, "a", "hi")
    assert job.overrides == {"max_tokens": 5, "temperature": 0.5, "seed": 1}


def test_messages_line_with_system():
    job = parse_line(1, '{"id": 7, "messages": [{"role": "user", "content": "x"}], "system": "s"}')
    assert isinstance(job, Job) and job.id == 7 and job.system == "s"
    assert job.messages == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "raw, has_id, words",
    [
        ("not json", False, "not valid JSON"),
        ("[1, 2]", False, "expected a JSON object"),
        ('{"prompt": "x"}', False, "missing 'id'"),
        ('{"id": 1.5, "prompt": "x"}', False, "'id' must be"),
        ('{"id": true, "prompt": "x"}', False, "'id' must be"),
        ('{"id": "a"}', True, "exactly one of 'prompt', 'messages' or 'input'"),
        ('{"id": "a", "prompt": "x", "messages": []}', True, "exactly one"),
        ('{"id": "a", "prompt": "  "}', True, "non-empty string"),
        ('{"id": "a", "messages": []}', True, "non-empty list"),
        (
            '{"id": "a", "messages": [{"role": "bot", "content": "x"}]}',
            True,
            "has message 0 that is not {",
        ),
        ('{"id": "a", "prompt": "x", "max_tokens": 0}', True, "'max_tokens'"),
        ('{"id": "a", "prompt": "x", "temperature": -1}', True, "'temperature'"),
        ('{"id": "a", "prompt": "x", "top_p": 0}', True, "'top_p'"),
        ('{"id": "a", "prompt": "x", "seed": "7"}', True, "'seed'"),
        ('{"id": "a", "prompt": "x", "seed": -1}', True, "'seed'"),
        ('{"id": "a", "prompt": "x", "temperature": Infinity}', True, "'temperature'"),
        ('{"id": "a", "prompt": "x", "top_p": NaN}', True, "'top_p'"),
        ('{"id": "a", "prompt": "x", "max_token": 9}', True, "unknown field(s) max_token"),
    ],
)
def test_bad_lines_say_what_is_wrong(raw, has_id, words):
    bad = parse_line(4, raw)
    assert isinstance(bad, BadLine)
    assert words in bad.error and "\n" not in bad.error
    rec = bad.record()
    assert rec["line"] == 4 and ("id" in rec) == has_id


@given(st.text())
def test_any_line_parses_or_becomes_an_error(raw):
    out = parse_line(1, raw)
    assert isinstance(out, (Job, BadLine))
    if isinstance(out, BadLine):
        json.dumps(out.record())  # always writable


def test_read_input_whole_file_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_input(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(UserError, match="is empty"):
        read_input(empty)
    notjson = tmp_path / "x.jsonl"
    notjson.write_text("hello\nworld\n")
    with pytest.raises(UserError, match="not JSONL"):
        read_input(notjson)
    with pytest.raises(UserError, match="directory"):
        read_input(tmp_path)


def test_read_input_keeps_line_numbers_and_skips_blank_lines(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"id": 1, "prompt": "a"}\n\nnot json\n{"id": 2, "prompt": "b"}\n')
    entries = read_input(p)
    assert [e.line for e in entries] == [1, 3, 4]
    assert isinstance(entries[1], BadLine)


def test_duplicates_point_at_the_first_line():
    entries = [
        parse_line(1, '{"id": "a", "prompt": "x"}'),
        parse_line(2, '{"id": 1, "prompt": "x"}'),
        parse_line(3, '{"id": "a", "prompt": "y"}'),
        parse_line(4, '{"id": "1", "prompt": "x"}'),  # "1" is not 1
        parse_line(5, '{"id": "a"}'),  # bad, but its id is still a duplicate
    ]
    assert find_duplicates(entries) == {3: 1, 5: 1}


# -- the output log ----------------------------------------------------------------------------


def test_log_appends_whole_lines_and_reads_them_back(tmp_path):
    out = tmp_path / "out.jsonl"
    with ResultLog(out) as log:
        log.append({"id": "a", "line": 1, "text": "é"})
        log.append({"line": 2, "error": "bad"})
    with ResultLog(out) as log:
        assert [(r.line, r.id, r.error) for r in log.existing] == [(1, "a", False), (2, None, True)]
        assert log.records == 2 and log.torn_bytes == 0
    assert read_records(out)[0]["text"] == "é"


def test_log_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    good = json.dumps({"id": "a", "line": 1, "text": "x"}) + "\n"
    torn = json.dumps({"id": "b", "line": 2, "text": "y"})[:15]
    out.write_text(good + torn)
    with ResultLog(out) as log:
        assert log.torn_bytes == len(torn)
        assert [r.id for r in log.existing] == ["a"]
        log.append({"id": "b", "line": 2, "text": "y"})
    assert [r["id"] for r in read_records(out)] == ["a", "b"]


def test_log_reads_openai_shaped_records_and_cuts_one_torn_first(tmp_path):
    """The records of OpenAI batch lines resume by custom_id, line and fp; a torn one, even
    as the file's only line, is cut (it starts as this command's records do)."""
    from types import SimpleNamespace

    from mlxkv.commands.batch_openai import error_record, result_record

    answer = SimpleNamespace(text="hi", finish_reason="stop", prompt_tokens=3, generation_tokens=1)
    done = result_record("r-1", 1, "f1", "m", answer)
    failed = error_record(7, 2, "f2", "bad")
    out = tmp_path / "out.jsonl"
    torn = json.dumps(done)[:60]  # past its "line": what marks a torn first record as ours
    out.write_text(torn)
    with ResultLog(out) as log:
        assert log.torn_bytes == len(torn) and log.existing == []
        log.append(done)
        log.append(failed)
    with ResultLog(out) as log:
        got = [(r.line, r.id, r.fingerprint, r.error) for r in log.existing]
        assert got == [(1, "r-1", "f1", False), (2, 7, "f2", True)]
    assert read_records(out) == [done, failed]


def test_log_refuses_a_foreign_file_and_leaves_it_alone(tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("my notes\nmore\n")
    with pytest.raises(UserError, match="not a batch record"):
        ResultLog(out).open()
    assert out.read_text() == "my notes\nmore\n"


@pytest.mark.parametrize(
    "deep",
    ["[" * 100000 + "]" * 100000, '{"line": 1, "x": ' + "[" * 100000],
    ids=["list", "record"],
)
def test_log_refuses_a_deeply_nested_file_and_leaves_it_alone(tmp_path, deep):
    """It was a RecursionError traceback."""
    out = tmp_path / "out.jsonl"
    out.write_text(deep + "\n")
    with pytest.raises(UserError, match="not a batch record"):
        ResultLog(out).open()
    assert out.read_text() == deep + "\n"


def test_log_missing_directory_and_directory_path(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ResultLog(tmp_path / "missing" / "out.jsonl").open()
    with pytest.raises(UserError, match="is a directory"):
        ResultLog(tmp_path).open()


def test_log_is_locked_against_a_second_writer(tmp_path):
    out = tmp_path / "out.jsonl"
    with ResultLog(out):
        with pytest.raises(UserError, match="another mlxkv batch"):
            ResultLog(out).open()
    with ResultLog(out):  # released on close
        pass


def test_log_survives_a_killed_writer(tmp_path):
    """A child appends records and is killed -9: every line it finished is intact."""
    out = tmp_path / "out.jsonl"
    pid = os.fork()
    if pid == 0:  # child
        try:
            log = ResultLog(out).open()
            for i in range(10**6):
                log.append({"id": i, "line": i + 1, "text": "x" * 100})
        finally:
            os._exit(0)
    import signal
    import time

    while not out.exists() or out.stat().st_size < 20000:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with ResultLog(out) as log:
        n = log.records
    recs = read_records(out)
    assert len(recs) == n and [r["id"] for r in recs] == list(range(n))
