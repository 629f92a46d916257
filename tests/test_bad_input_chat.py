"""``mlxkv chat`` with bad input: refused before the screen opens (exit 2, one line, no
traceback), and every user file left byte-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_input import refused, snapshot, truncated_copy


@pytest.fixture(autouse=True)
def _no_screen(monkeypatch, tmp_path):
    def refuse(*a, **k):
        raise AssertionError("the chat screen was opened")

    monkeypatch.setattr("tui.app.ChatApp.run", refuse)
    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--temp", "nan"], "--temp must be at least 0, got nan"),
        (["--top-k", "-1"], "--top-k must be at least 0"),
        (["--min-p", "5"], "--min-p must be in [0, 1]"),
        (["--seed", "-1"], "--seed must be in [0,"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--prefill-step", "0"], "--prefill-step must be at least 1"),
        (["--kv-window", "-3"], "--kv-window"),
        (["--kv-bits", "7"], "--kv-bits"),
        (["a-model", "--model", "another"], "two models given: 'a-model' and --model"),
    ],
)
def test_bad_flags(capsys, flags, words):
    assert words in refused(capsys, "chat", *flags)


def test_unknown_model(capsys):
    err = refused(capsys, "chat", "no-such-model")
    assert "unknown model 'no-such-model'" in err and "mlxkv models" in err


def test_folder_that_is_not_a_model(capsys, tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("mine")
    before = snapshot(folder)
    assert "folder without config.json" in refused(capsys, "chat", str(folder))
    assert snapshot(folder) == before


def test_missing_gguf(capsys, tmp_path):
    assert "GGUF file not found" in refused(capsys, "chat", str(tmp_path / "m.gguf"))


def test_truncated_weights(capsys, tmp_path, default_model_path):
    folder = truncated_copy(default_model_path, tmp_path / "model")
    before = snapshot(folder)
    assert "truncated" in refused(capsys, "chat", str(folder))
    assert snapshot(folder) == before


def test_resume_with_nothing_saved(capsys, tmp_path):
    assert "no saved conversation in" in refused(capsys, "chat", "--resume")


def test_resume_skips_unreadable_files_and_keeps_them(capsys, tmp_path):
    chats = tmp_path / "home" / "chats"
    chats.mkdir(parents=True)
    (chats / "chat-1.json").write_text('{"messages": [')  # torn by a crash elsewhere
    (chats / "chat-2.json").write_bytes(b"\xff\xfe binary")
    before = snapshot(chats)
    assert "no saved conversation in" in refused(capsys, "chat", "--resume")
    assert snapshot(chats) == before


def test_resume_with_a_policy_this_version_refuses(capsys, tmp_path):
    chats = tmp_path / "home" / "chats"
    chats.mkdir(parents=True)
    saved = {"messages": [{"role": "user", "content": "hi"}], "policy": {"window": -5}}
    (chats / "chat-1.json").write_text(json.dumps(saved))
    before = snapshot(chats)
    assert "window" in refused(capsys, "chat", "--resume", "-m", "smollm2-135m")
    assert snapshot(chats) == before


def test_home_that_is_a_file(capsys, monkeypatch, tmp_path):
    home = tmp_path / "home-file"
    home.write_text("mine")
    monkeypatch.setenv("MLXKV_HOME", str(home))
    assert "MLXKV_HOME=" in refused(capsys, "chat", "--resume")
    assert home.read_text() == "mine"


def test_metrics_never_overwrites_a_user_file(capsys, tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"keep": 1}')
    err = refused(capsys, "chat", "--metrics", str(notes))
    assert "is not a metrics file written by mlxkv chat" in err
    assert notes.read_text() == '{"keep": 1}'


@pytest.mark.parametrize("where, words", [("missing/m.json", "does not exist"), (".", "folder")])
def test_metrics_path_checked_first(capsys, tmp_path, where, words):
    assert words in refused(capsys, "chat", "--metrics", str(tmp_path / where))


def test_metrics_of_an_earlier_run_is_replaced_whole(tmp_path):
    from tui.metrics import check_metrics_path, write_metrics

    path = tmp_path / "m.json"
    write_metrics(path, {"turns": [{"tok_s": 1.0}], "panel_renders": 3})
    assert check_metrics_path(str(path)) == path  # accepted: mlxkv wrote it
    write_metrics(path, {"turns": [], "panel_renders": 1})
    assert json.loads(path.read_text()) == {"turns": [], "panel_renders": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # no temporary left behind


def _saved(tmp_path, data) -> Path:
    chats = tmp_path / "home" / "chats"
    chats.mkdir(parents=True, exist_ok=True)
    path = chats / "chat-1.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "data, words",
    [
        ({"messages": [{"role": "user", "content": 5}]}, "message 1 is not a {role, content}"),
        ({"messages": HI, "model": 7}, "'model' must be a string, got int"),
        ({"messages": HI, "model_arg": ["x"]}, "'model_arg' must be a string, got list"),
        ({"messages": HI, "system": {"a": 1}}, "'system' must be a string, got dict"),
        ({"messages": [["user", "hi"]]}, "message 1 is not a {role, content}"),
        ({"messages": "hi"}, "not a conversation file"),
        ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests arrays/objects deeper"),
        ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
    ],
)
def test_resume_of_a_file_with_wrong_types_says_why(capsys, tmp_path, data, words):
    path = _saved(tmp_path, data)
    before = path.read_bytes()
    err = refused(capsys, "chat", "--resume")
    assert "no saved conversation in" in err and "1 unreadable: cannot load conversation" in err
    assert words in err
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "policy, words",
    [
        ("window=64", "'policy' must be an object, got str"),
        ({"bits": 99}, "'policy.bits' is 99; the KV caches take 2, 3, 4, 5, 6, 8 bits"),
        ({"window": "64"}, "'policy.window' must be a whole number or null, got '64'"),
        ({"window": 8, "sinks": 8}, "'policy.sinks' is 8; sinks need a window larger"),
        ({"group_size": 7}, "'policy.group_size' is 7; the KV caches take groups of 32"),
    ],
)
def test_resume_with_a_bad_saved_policy_names_the_saved_field(capsys, tmp_path, policy, words):
    path = _saved(tmp_path, {"messages": HI, "policy": policy})
    before = path.read_bytes()
    err = refused(capsys, "chat", "--resume", "-m", "smollm2-135m")
    assert words in err and f"cannot load conversation {path}" in err
    assert "--kv" not in err  # no flag the user did not give
    assert path.read_bytes() == before


def test_metrics_that_is_a_device_or_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        out = subprocess.run(
            [sys.executable, "-m", "mlxkv", "chat", "--metrics", path],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "MLXKV_HOME": str(tmp_path / "home")},
        )
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == (
            f"mlxkv chat: error: --metrics {path} is not a regular file; give a file path\n"
        )


def test_reading_a_conversation_never_blocks_or_grows(tmp_path):
    """A FIFO (no writer: open() would block) and /dev/zero (endless) are refused at once."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    script = (
        "import sys\nfrom tui.conversations import read_conversation\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n        read_conversation(p)\n"
        "    except Exception as e:\n        print(type(e).__name__, e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(fifo), "/dev/zero"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parent.parent,
    )
    assert out.stdout.splitlines() == [
        f"UserError cannot load conversation {fifo} is not a regular file; name a regular file",
        "UserError cannot load conversation /dev/zero is not a regular file; name a regular file",
    ]
