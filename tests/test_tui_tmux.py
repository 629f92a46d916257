"""End to end in a real terminal: ``mlxkv chat`` inside tmux, driven by keystrokes."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

WIDTH, HEIGHT = 140, 45


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def wait_pane(session: str, condition, timeout: float, step: float = 0.5) -> str:
    end = time.monotonic() + timeout
    while True:
        pane = tmux("capture-pane", "-p", "-t", session)
        if condition(pane):
            return pane
        if time.monotonic() > end:
            raise AssertionError(f"timed out; the pane shows:\n{pane}")
        time.sleep(step)


class Chat:
    """``mlxkv chat ARGS`` in a tmux session, with its own MLXKV_HOME."""

    def __init__(self, home, *args: str):
        self.session = f"mlxkv-{uuid.uuid4().hex[:8]}"
        self.done = home / f"{self.session}.exit"
        cmd = shlex.join([sys.executable, "-m", "mlxkv", "chat", *args])
        env = f"MLXKV_HOME={shlex.quote(str(home))}"
        script = f"{env} {cmd}; echo $? > {shlex.quote(str(self.done))}"
        tmux("new-session", "-d", "-s", self.session, "-x", str(WIDTH), "-y", str(HEIGHT))
        tmux("send-keys", "-t", self.session, script, "Enter")

    def keys(self, *keys: str, literal: bool = False) -> None:
        tmux("send-keys", "-t", self.session, *(["-l"] if literal else []), *keys)

    def type(self, text: str) -> None:
        self.keys(text, literal=True)
        self.keys("Enter")

    def wait(self, condition, timeout: float = 300, step: float = 0.5) -> str:
        return wait_pane(self.session, condition, timeout, step)

    def exit_code(self, timeout: float = 30) -> int:
        end = time.monotonic() + timeout
        while not self.done.exists():
            assert time.monotonic() < end, "mlxkv chat did not exit"
            time.sleep(0.2)
        return int(self.done.read_text())

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)


def test_loading_failed_load_and_ctrl_c(tmp_path, default_model_path):
    model = str(default_model_path)
    chat = Chat(tmp_path, model, "--max-tokens", "200", "--temp", "0")
    try:
        # the loading screen: which model, from where, and the weights as they are read
        pane = chat.wait(lambda p: "weights " in p and " of " in p, step=0.1)
        assert f"Loading {model}" in pane and "from " in pane and "local folder" in pane
        assert "Ctrl+Q quits" in pane
        chat.wait(lambda p: "Enter send" in p and "loaded" in p)
        chat.keys("C-c")  # idle: it says how to quit, and does not quit
        chat.wait(lambda p: "Ctrl+Q quits" in p, timeout=10)
        assert not chat.done.exists()
        # Ctrl+C stops a streaming answer
        chat.type("Write a long story about a dragon.")
        chat.wait(lambda p: "answering" in p and "Once" in p)
        chat.keys("C-c")
        pane = chat.wait(lambda p: "stopped ·" in p, timeout=60)
        assert "Enter send" in pane and not chat.done.exists()
        # a failed load shows its error at once (no resize needed), Esc leaves a trace
        chat.type("/model /tmp/no-such-model")
        pane = chat.wait(lambda p: "Could not load the model" in p, timeout=30)
        assert "unknown model '/tmp/no-such-model'" in pane and "Esc goes back" in pane
        chat.keys("Escape")
        pane = chat.wait(lambda p: "still using" in p, timeout=30)
        assert "could not load the model" in pane
        chat.keys("C-q")
        assert chat.exit_code() == 0
    finally:
        chat.close()


@pytest.mark.slow
def test_answer_panel_and_resume_after_quitting(tmp_path, default_model_path):
    model = str(default_model_path)
    metrics = tmp_path / "metrics.json"
    chat = Chat(tmp_path, model, "--kv-window", "64", "--max-tokens", "32", "--temp", "0")
    chat_args = ["--metrics", str(metrics)]
    try:
        chat.wait(lambda p: "Enter send" in p and "loaded" in p)
        chat.type("What is the capital of France?")
        pane = chat.wait(lambda p: "done ·" in p or "length ·" in p)
        assert "Paris" in pane and "sink 4 + window 64" in pane
        assert "exact" in pane
        chat.keys("C-q")
        assert chat.exit_code() == 0
    finally:
        chat.close()
    (kept,) = (tmp_path / "chats").glob("chat-*.json")
    assert json.loads(kept.read_text())["policy"]["window"] == 64
    chat = Chat(tmp_path, "--resume", "--max-tokens", "16", *chat_args)
    try:
        pane = chat.wait(lambda p: "resumed the last conversation" in p)
        assert "What is the capital of France?" in pane and "Paris" in pane
        assert "sink 4 + window 64" in pane  # the policy came back with it
        chat.type("And of Germany?")
        chat.wait(lambda p: "And of Germany?" in p and ("done ·" in p or "length ·" in p))
        turn = json.loads(metrics.read_text())["turns"][-1]
        assert turn["kv_bytes_actual"] == turn["kv_bytes_predicted"] > 0
        chat.keys("C-q")
        assert chat.exit_code() == 0
    finally:
        chat.close()
    assert len(json.loads(kept.read_text())["messages"]) == 4
    assert os.listdir(tmp_path / "chats") == [kept.name]  # no temporary files left behind


@pytest.mark.slow  # the exit itself is checked in tests/test_tui_worker.py
def test_quit_after_a_policy_change_and_mid_answer_exits_0_with_the_chat_kept(
    tmp_path, default_model_path
):
    """Ctrl+Q after an answer under a changed policy, then during the next answer: exit 0
    (this once aborted with SIGABRT), and the kept conversation holds the cut answer."""
    chat = Chat(tmp_path, str(default_model_path), "--max-tokens", "300", "--temp", "0")
    try:
        chat.wait(lambda p: "Enter send" in p and "loaded" in p)
        chat.type("/policy window=99999")
        chat.wait(lambda p: "KV policy is now" in p or "policy unchanged" in p, timeout=60)
        chat.type("What is the capital of France?")
        chat.wait(lambda p: "done ·" in p)
        chat.type("Write a long story about a dragon.")
        chat.wait(lambda p: "answering" in p and "Once" in p)
        chat.keys("C-q")
        assert chat.exit_code() == 0
    finally:
        chat.close()
    (kept,) = (tmp_path / "chats").glob("chat-*.json")
    messages = json.loads(kept.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert "Paris" in messages[1]["content"]
    assert messages[3]["content"].startswith("Once")  # cut short, but kept
