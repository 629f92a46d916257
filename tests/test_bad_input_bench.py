"""``mlxkv bench`` with bad input: refused before any work, nothing created or changed."""

from __future__ import annotations

import pytest

from tests.bad_input import refused, snapshot


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("some text\n")
    return p


@pytest.mark.parametrize("flag", ["--kept", "--repeats", "--stream-tokens", "--workers"])
def test_zero_counts_are_refused(capsys, tmp_path, text, flag):
    out = tmp_path / "new"
    err = refused(capsys, "bench", "--quick", "--text", str(text), "--out", str(out), flag, "0")
    assert f"{flag} must be at least 1, got 0" in err
    assert not out.exists()


def test_out_that_is_a_file(capsys, tmp_path, text):
    out = tmp_path / "existing"
    out.write_text("keep me")
    assert "is a file" in refused(capsys, "bench", "--text", str(text), "--out", str(out))
    assert out.read_text() == "keep me"


def test_out_folder_with_other_files(capsys, tmp_path, text):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "benchmarks.md").write_text("my notes")
    before = snapshot(out)
    assert "not a bench report" in refused(capsys, "bench", "--text", str(text), "--out", str(out))
    assert snapshot(out) == before


@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_bad_text_is_checked_before_out_is_made(capsys, tmp_path, kind):
    text = {"missing": tmp_path / "nope.txt", "directory": tmp_path}.get(kind)
    if kind == "binary":
        text = tmp_path / "b.bin"
        text.write_bytes(b"\xff\xfe\x00")
    out = tmp_path / "fresh"
    assert "--text" in refused(capsys, "bench", "--text", str(text), "--out", str(out))
    assert not out.exists()


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo"])
def test_text_that_never_ends_is_refused_at_once(capsys, tmp_path, kind):
    import os

    path = kind
    if kind == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    out = tmp_path / "new"
    line = refused(capsys, "bench", "--text", str(path), "--out", str(out))
    assert f"--text {path} is not a regular file" in line
    assert not out.exists()


@pytest.mark.parametrize(
    "files",
    [
        {"bench-results.json": '{"mine": 1}', "benchmarks.md": "MY REPORT"},
        {"bench-results.json": "not json"},
        {
            "bench-results.json": '{"machine": {}, "model": {}, "scale": {}, "total_seconds": 1}',
            "benchmarks.md": "# My own benchmarks",
        },
    ],
    ids=["other json", "not json", "other markdown"],
)
def test_files_with_a_reports_names_are_not_replaced(capsys, tmp_path, text, files):
    """Only what a run wrote is replaced: a bench-results.json of the user's was taken for
    an earlier report, and both files were overwritten."""
    out = tmp_path / "existing"
    out.mkdir()
    for name, content in files.items():
        (out / name).write_text(content)
    before = snapshot(out)
    line = refused(capsys, "bench", "--quick", "--text", str(text), "--out", str(out))
    assert line == (
        f"mlxkv bench: error: --out {out} holds files that are not a bench report; give a new "
        "or empty folder"
    )
    assert snapshot(out) == before


def test_out_that_cannot_be_made_and_only_nothing(capsys, tmp_path, text):
    (tmp_path / "file").write_text("keep me")
    line = refused(
        capsys, "bench", "--quick", "--text", str(text), "--out", str(tmp_path / "file" / "sub")
    )
    assert line == (
        f"mlxkv bench: error: --out {tmp_path / 'file' / 'sub'}: cannot create the folder "
        "(Not a directory)"
    )
    line = refused(capsys, "bench", "--text", str(text), "--only", "", "--out", str(tmp_path / "o"))
    assert line.startswith("mlxkv bench: error: --only names no section; use some of engine,")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "t.txt"]


def test_a_model_that_cannot_resolve_is_refused_before_out_is_made(capsys, tmp_path, text):
    out = tmp_path / "fresh"
    line = refused(capsys, "bench", "--text", str(text), "--model", "bogus", "--out", str(out))
    assert line.startswith("mlxkv bench: error: unknown model 'bogus': not a local folder,")
    assert not out.exists()
