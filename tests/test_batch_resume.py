"""Resume decisions and the output file's safety checks: pure functions, no model."""

from __future__ import annotations

import json

import pytest

from mlxkv.commands.batch_output import ResultLog, read_records
from mlxkv.commands.batch_resume import (
    ResumeEntry,
    ResumeRecord,
    line_fingerprint,
    plan_resume,
    run_context,
)
from mlxkv.errors import UserError

CTX = run_context(model="m", policy={"window": None}, settings={"temperature": 0.0})


def _entry(line, ident, prompt="p", ctx=CTX, runnable=True):
    return ResumeEntry(
        line, ident, line_fingerprint({"id": ident, "prompt": prompt}, ctx), runnable
    )


def _rec(entry, error=False, line=None, ident="same"):
    return ResumeRecord(
        entry.line if line is None else line,
        entry.id if ident == "same" else ident,
        entry.fingerprint,
        error,
    )


# -- fingerprints ------------------------------------------------------------------------------
def test_fingerprint_ignores_key_order_but_not_content():
    a = line_fingerprint({"id": 1, "prompt": "x"}, CTX)
    assert a == line_fingerprint({"prompt": "x", "id": 1}, CTX)
    assert a != line_fingerprint({"id": 1, "prompt": "y"}, CTX)
    assert a != line_fingerprint({"id": 1, "prompt": "x", "temperature": 0.5}, CTX)


@pytest.mark.parametrize(
    "changed",
    [
        {"model": "other"},
        {"policy": {"window": 64}},
        {"settings": {"temperature": 0.7}},
        {"system": "be brief"},
    ],
)
def test_fingerprint_changes_with_the_run(changed):
    base = {"model": "m", "policy": {"window": None}, "settings": {"temperature": 0.0}}
    other = run_context(**{**base, **changed})
    payload = {"id": 1, "prompt": "x"}
    assert line_fingerprint(payload, run_context(**base)) != line_fingerprint(payload, other)


def test_fingerprint_of_raw_bytes_differs_from_text():
    assert line_fingerprint(b"caf\xe9", CTX) != line_fingerprint(b"cafe", CTX)


# -- plan_resume: one case per rule --------------------------------------------------------------
def test_nothing_written_runs_everything():
    es = [_entry(1, "a"), _entry(2, "b")]
    plan = plan_resume(es, [])
    assert (plan.run, plan.done, plan.changed, plan.foreign) == ([1, 2], [], [], [])


def test_matching_records_are_done():
    es = [_entry(1, "a"), _entry(2, "b")]
    plan = plan_resume(es, [_rec(es[1])])
    assert (plan.run, plan.done) == ([1], [2])


def test_changed_prompt_is_run_again():
    old = _entry(1, "a", prompt="old")
    new = _entry(1, "a", prompt="new")
    plan = plan_resume([new], [_rec(old)])
    assert (plan.run, plan.changed, plan.done) == ([1], [1], [])


def test_changed_run_settings_rerun_every_line():
    other = run_context(model="m", policy={"window": None}, settings={"temperature": 0.9})
    old = [_entry(1, "a"), _entry(2, "b")]
    new = [_entry(1, "a", ctx=other), _entry(2, "b", ctx=other)]
    plan = plan_resume(new, [_rec(e) for e in old])
    assert plan.changed == [1, 2]


def test_record_without_fingerprint_counts_as_changed():
    e = _entry(1, "a")
    plan = plan_resume([e], [ResumeRecord(1, "a", None, False)])
    assert plan.changed == [1]


def test_error_records_are_kept_unless_retried():
    e = _entry(1, "a")
    kept = plan_resume([e], [_rec(e, error=True)])
    assert (kept.run, kept.done, kept.errors_kept) == ([], [1], [1])
    retried = plan_resume([e], [_rec(e, error=True)], retry_errors=True)
    assert (retried.run, retried.retried, retried.errors_kept) == ([1], [1], [])


def test_input_errors_are_not_retried():
    e = _entry(1, None, runnable=False)
    plan = plan_resume([e], [_rec(e, error=True)], retry_errors=True)
    assert (plan.run, plan.errors_kept) == ([], [1])


def test_the_last_record_of_a_line_is_its_answer():
    e = _entry(1, "a")
    after_retry = plan_resume([e], [_rec(e, error=True), _rec(e)])
    assert (after_retry.done, after_retry.errors_kept) == ([1], [])
    after_failure = plan_resume([e], [_rec(e), _rec(e, error=True)])
    assert after_failure.errors_kept == [1]


def test_reordered_input_matches_by_id():
    old = [_entry(1, "a"), _entry(2, "b")]
    new = [_entry(1, "b"), _entry(2, "a")]
    plan = plan_resume(new, [_rec(e) for e in old])
    assert (plan.run, plan.done, plan.foreign) == ([], [1, 2], [])


def test_duplicate_id_lines_keep_their_own_records():
    first = _entry(1, "a")
    dup = ResumeEntry(3, "a", line_fingerprint({"id": "a", "x": 1}, CTX), runnable=False)
    plan = plan_resume([first, dup], [_rec(dup, error=True)])
    # The duplicate's error record answers line 3 only; line 1 still has to run.
    assert (plan.run, plan.done) == ([1], [3])


def test_lines_without_id_match_by_line_number():
    e = ResumeEntry(2, None, line_fingerprint(b"garbage", CTX), runnable=False)
    assert plan_resume([e], [_rec(e, error=True)]).done == [2]


def test_records_of_another_input_are_foreign():
    es = [_entry(1, "a")]
    stranger = ResumeRecord(1, "zz", "0" * 16, False)
    plan = plan_resume(es, [stranger])
    assert plan.foreign == [stranger] and plan.run == [1]
    beyond = ResumeRecord(7, None, "0" * 16, True)
    assert plan_resume(es, [beyond]).foreign == [beyond]


def test_an_error_record_of_a_line_fixed_or_deleted_is_no_ones():
    """Line 2 was not JSON (an error record without an id); the user deleted it, as the
    hint to fix the input lines suggests: resuming was refused as another input's file."""
    a, broken, c = _entry(1, "a"), ResumeEntry(2, None, "f" * 16, runnable=False), _entry(3, "c")
    records = [_rec(a), _rec(broken, error=True), _rec(c)]
    fixed = [_entry(1, "a"), _entry(2, "c")]  # line 2 deleted: c moves up
    plan = plan_resume(fixed, records)
    assert (plan.run, plan.done, plan.foreign) == ([], [1, 2], [])
    # with nothing else matching, the file is still another input's
    alone = plan_resume([_entry(1, "x")], [_rec(broken, error=True)])
    assert alone.foreign == [_rec(broken, error=True)] and alone.run == [1]


# -- read_records: the file check, before anything changes ---------------------------------------
REC = json.dumps({"id": "a", "line": 1, "text": "x", "fp": "f"})


def test_records_read_back():
    recs, torn, nl = read_records((REC + "\n").encode(), "o")
    assert recs == [ResumeRecord(1, "a", "f", False)] and (torn, nl) == (0, False)


def test_complete_last_record_without_newline_is_kept():
    recs, torn, nl = read_records(REC.encode(), "o")
    assert len(recs) == 1 and (torn, nl) == (0, True)


def test_torn_last_record_is_cut():
    torn_tail = REC[:12]
    recs, torn, nl = read_records((REC + "\n" + torn_tail).encode(), "o")
    assert len(recs) == 1 and torn == len(torn_tail) and not nl


@pytest.mark.parametrize(
    "data",
    [
        b'{"keep":1}',  # a JSON file of the user's, no newline
        b'{"keep":1}\n',
        b"line one\nline two",  # prose: the last line must not be cut
        b'{"id": 1, "prompt": "hi"}\n{"id": 2, "prompt": "yo"}',  # an input file
        (REC + "\nnot a record\n").encode(),
        (REC + "\n" + '{"id": "b", "line": 2}').encode(),  # neither text nor error
        b'{"line": 0, "text": "x"}\n',
        b"\xff\xfe binary",
    ],
)
def test_anything_but_records_is_refused(data):
    with pytest.raises(UserError, match="not a batch record"):
        read_records(data, "o")


@pytest.mark.parametrize(
    "data",
    [b'{"keep":1}', b"line one\nline two", b'{"id": 1, "prompt": "hi"}\n{"id": 2, "pro'],
)
def test_refused_output_file_is_byte_identical(tmp_path, data):
    out = tmp_path / "user.json"
    out.write_bytes(data)
    with pytest.raises(UserError, match="left untouched"):
        ResultLog(out).open()
    assert out.read_bytes() == data


def test_last_record_without_newline_gets_one_before_the_next(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(REC.encode())
    with ResultLog(out) as log:
        assert len(log.existing) == 1 and log.torn_bytes == 0
        log.append({"id": "b", "line": 2, "error": "e", "fp": "g"})
    assert (
        out.read_bytes()
        == (REC + "\n").encode() + b'{"id": "b", "line": 2, "error": "e", "fp": "g"}\n'
    )


def test_a_lone_partial_line_is_cut_only_if_it_reached_a_record_line_field():
    recs, torn, _ = read_records(b'{"id": 7, "line": 3, "te', "o")
    assert recs == [] and torn == 24
    with pytest.raises(UserError, match="not a batch record"):
        read_records(b'{"id": 2, "prompt": "unfinished', "o")
