"""``mlxkv batch`` against hostile input: exit code, one clean line, user files unchanged."""

from __future__ import annotations

import errno
import io

import pytest

from mlxkv.cli import main
from tests.batch_files import read_records, write_lines


def _one_clean_line(err: str, words: str) -> None:
    lines = [x for x in err.splitlines() if x.startswith("mlxkv batch: error:")]
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err


GOOD = [{"id": 1, "prompt": "hi"}]


@pytest.mark.parametrize(
    "content",
    [
        b'{"keep":1}',
        b'{"keep":1}\n',
        b"line one\nline two",
        b'{"id": 1, "prompt": "mine"}\n{"id": 2, "prompt": "last, no newline"}',
        b'{"id": 2, "prompt": "unfinish',
    ],
)
def test_foreign_output_is_refused_and_byte_identical(tmp_path, capsys, no_model, content):
    inp = write_lines(tmp_path / "good.jsonl", GOOD)
    out = tmp_path / "important.json"
    out.write_bytes(content)
    assert main(["batch", str(inp), "-o", str(out)]) == 2
    _one_clean_line(capsys.readouterr().err, "not a batch record")
    assert out.read_bytes() == content


def test_swapped_file_names_leave_the_input_whole(tmp_path, capsys, no_model):
    """`batch OUT -o IN` by mistake: the prompts file is refused as an output, untouched."""
    prompts = b'{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"}'
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(prompts)
    out = write_lines(tmp_path / "out.jsonl", [{"id": 1, "line": 1, "error": "x", "fp": "f"}])
    before = out.read_bytes()
    assert main(["batch", str(out), "-o", str(inp)]) == 2
    _one_clean_line(capsys.readouterr().err, "not a batch record")
    assert inp.read_bytes() == prompts and out.read_bytes() == before


def test_output_of_another_input_is_refused(tmp_path, capsys, no_model):
    out = write_lines(tmp_path / "out.jsonl", [{"id": "zz", "line": 1, "text": "t", "fp": "f"}])
    before = out.read_bytes()
    inp = write_lines(tmp_path / "in.jsonl", GOOD)
    assert main(["batch", str(inp), "-o", str(out)]) == 2
    _one_clean_line(capsys.readouterr().err, "belongs to another input")
    assert out.read_bytes() == before


def test_output_that_is_not_a_regular_file(tmp_path, capsys, no_model):
    inp = write_lines(tmp_path / "in.jsonl", GOOD)
    assert main(["batch", str(inp), "-o", "/dev/full"]) == 2
    _one_clean_line(capsys.readouterr().err, "not a regular file")


def test_non_utf8_line_becomes_an_error_record(tmp_path, capsys, no_model):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"id": 1, "prompt": "caf\xe9"}\n{"id": 2}\n')
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    recs = read_records(out)
    assert [r["line"] for r in recs] == [1, 2]
    assert "not UTF-8" in recs[0]["error"] and "exactly one" in recs[1]["error"]
    assert "Traceback" not in capsys.readouterr().err


def test_conversations_are_checked_as_generate_checks_them(tmp_path, capsys, no_model):
    lines = [
        [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}],
        [{"role": "system", "content": "s"}],
        [{"role": "bot", "content": "s"}],
        [],
    ]
    inp = write_lines(
        tmp_path / "in.jsonl", [{"id": i, "messages": m} for i, m in enumerate(lines)]
    )
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    assert [r["error"] for r in read_records(out)] == [
        "'messages' has a system message at 1; a system message may only come first",
        "'messages' has no user message to answer",
        "'messages' has message 0 that is not "
        '{"role": "system"|"user"|"assistant", "content": "text"}',
        """'messages' must be a non-empty list of {"role", "content"} objects""",
    ]


def test_lone_surrogate_lines_become_error_records_and_resume(tmp_path, capsys, no_model):
    """A \\ud800 escape (in the prompt, or in the id the record carries back) is that line's
    error; the records are JSON a reader can parse, and a second run finds them done."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"id": 1, "prompt": "\\ud800"}\n{"id": "\\udc00x", "prompt": "hi"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    recs = read_records(out)
    assert [(r["id"], r["line"]) for r in recs] == [(1, 1), ("\udc00x", 2)]
    assert recs[0]["error"] == "holds '\\ud800', a lone surrogate that is not valid text"
    assert b"\\udc00x" in out.read_bytes()  # kept escaped: the file stays UTF-8
    assert "Traceback" not in capsys.readouterr().err
    before = out.read_bytes()
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    assert out.read_bytes() == before
    assert "2 lines are answered by error records" in capsys.readouterr().err


def test_stdin_input(tmp_path, capsys, monkeypatch, no_model):
    stdin = io.TextIOWrapper(io.BytesIO(b'{"id": "s"}\n'))
    monkeypatch.setattr("sys.stdin", stdin)
    out = tmp_path / "out.jsonl"
    assert main(["batch", "-", "-o", str(out)]) == 1
    assert read_records(out)[0]["id"] == "s"


def test_closed_stdin(tmp_path, capsys, monkeypatch, no_model):
    stdin = io.TextIOWrapper(io.BytesIO(b""))
    stdin.close()
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["batch", "-", "-o", str(tmp_path / "o.jsonl")]) == 2
    _one_clean_line(capsys.readouterr().err, "stdin")


def test_changed_settings_rerun_or_strict_refuses(tmp_path, capsys, no_model):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x", "max_tokens": 0}])
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    assert len(read_records(out)) == 1  # same run: nothing added
    assert main(["batch", str(inp), "-o", str(out), "--temp", "0.5"]) == 1
    recs = read_records(out)
    assert len(recs) == 2 and recs[0]["fp"] != recs[1]["fp"]  # a new record for the new run
    before = out.read_bytes()
    capsys.readouterr()
    args = ["batch", str(inp), "-o", str(out), "--kv-window", "64", "--resume", "strict"]
    assert main(args) == 2
    _one_clean_line(capsys.readouterr().err, "1 lines changed")
    assert out.read_bytes() == before
    write_lines(inp, [{"id": 1, "prompt": "y", "max_tokens": 0}])  # the prompt changed
    assert main(["batch", str(inp), "-o", str(out), "--temp", "0.5"]) == 1
    assert len(read_records(out)) == 3


def test_disk_full_is_one_line_and_keeps_what_was_written(tmp_path, capsys, monkeypatch, no_model):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1}, {"id": 2}])
    out = tmp_path / "out.jsonl"
    real_write = __import__("os").write
    calls = []

    def full_after_one(fd, data):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr("mlxkv.commands.batch_output.os.write", full_after_one)
    assert main(["batch", str(inp), "-o", str(out)]) == 2
    _one_clean_line(capsys.readouterr().err, "disk is full")
    assert [r["line"] for r in read_records(out)] == [1]


@pytest.mark.model
def test_error_records_exit_1_and_retry_errors(tmp_path, capsys, preloaded):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    inp = write_lines(
        tmp_path / "in.jsonl",
        [{"id": 1, "messages": msgs, "system": "both"}, {"id": 2}],  # fails at run, at parse
    )
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out)]) == 1
    assert "2 errors" in capsys.readouterr().err  # the progress bar counts both
    assert len(preloaded) == 1
    before = out.read_bytes()
    assert main(["batch", str(inp), "-o", str(out)]) == 1  # finished, still errors: exit 1
    assert out.read_bytes() == before and len(preloaded) == 1
    assert "--retry-errors" in capsys.readouterr().err
    assert main(["batch", str(inp), "-o", str(out), "--retry-errors"]) == 1
    recs = read_records(out)
    assert out.read_bytes().startswith(before)
    # Line 1 ran again (a new record); line 2 is an input error, not retried.
    assert [r["line"] for r in recs] == [2, 1, 1] and len(preloaded) == 2


@pytest.mark.parametrize("source", ["/dev/zero", "fifo"])
def test_input_that_never_ends_is_refused_at_once(tmp_path, capsys, no_model, source):
    import os

    path = source
    if source == "fifo":
        path = tmp_path / "in.jsonl"
        os.mkfifo(path)
    assert main(["batch", str(path), "-o", str(tmp_path / "out.jsonl")]) == 2
    _one_clean_line(capsys.readouterr().err, "is not a regular file")
    assert not (tmp_path / "out.jsonl").exists()


def test_deep_long_and_surrogate_lines_are_line_errors():
    from mlxkv.commands.batch_input import LINE_LIMIT, BadLine, Job, parse_line

    deep = parse_line(1, '{"id": 1, "prompt": ' + "[" * 100000 + "]" * 100000 + "}")
    assert isinstance(deep, BadLine) and deep.error == "JSON nested deeper than 64 levels"
    sur = parse_line(2, '{"id": 2, "prompt": "a\\ud800"}')
    assert isinstance(sur, BadLine) and sur.error.startswith("holds '\\ud800', a lone surrogate")
    msg = parse_line(3, '{"id": 3, "messages": [{"role": "user", "content": "\\udfff"}]}')
    assert isinstance(msg, BadLine) and "lone surrogate" in msg.error
    long = parse_line(4, '{"id": 4, "prompt": "' + "x" * LINE_LIMIT + '"}')
    assert long.error == (
        f"the line is {LINE_LIMIT + 23:,} characters, more than the {LINE_LIMIT:,} a line may "
        "hold; shorten it"
    )
    assert isinstance(parse_line(5, '{"id": 5, "prompt": "\\ud83d\\ude00"}'), Job)


@pytest.mark.model
def test_huge_prompt_is_refused_before_the_tokenizer_reads_it(
    tmp_path, capsys, preloaded, default_model, monkeypatch
):
    """A 4 MB prompt cannot fit an 8192-token context: refused by its length, never
    tokenized (it was tokenized in full before: 6.8 GB and 81 s for 50 MB)."""
    tok = default_model.tokenizer._tokenizer
    seen = []
    real = type(tok).encode

    def encode(self, text, *a, **k):
        seen.append(len(text))
        return real(self, text, *a, **k)

    monkeypatch.setattr(type(tok), "encode", encode)
    inp = write_lines(
        tmp_path / "in.jsonl", [{"id": 1, "prompt": "x " * 2_000_000}, {"id": 2, "prompt": "hi"}]
    )
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), "-o", str(out), "--max-tokens", "2"]) == 1
    recs = {r["id"]: r for r in read_records(out)}
    assert recs[1]["error"].startswith("the prompt is 400")
    assert "characters, more than the model's context of 8192 tokens" in recs[1]["error"]
    assert "error" not in recs[2]
    assert max(seen) < 1000
