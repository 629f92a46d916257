"""End to end in a real terminal: ``mlxkv chat`` inside tmux, driven by keystrokes."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

WIDTH, HEIGHT = 140, 45


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def wait_pane(session: str, condition, timeout: float) -> str:
    end = time.monotonic() + timeout
    while True:
        pane = tmux("capture-pane", "-p", "-t", session)
        if condition(pane):
            return pane
        if time.monotonic() > end:
            raise AssertionError(f"timed out; the pane shows:\n{pane}")
        time.sleep(0.5)


def test_chat_in_tmux(tmp_path, default_model_path):
    session = f"mlxkv-{uuid.uuid4().hex[:8]}"
    metrics = tmp_path / "metrics.json"
    cmd = [sys.executable, "-m", "mlxkv", "chat", "--max-tokens", "32", "--metrics", str(metrics)]
    tmux("new-session", "-d", "-s", session, "-x", str(WIDTH), "-y", str(HEIGHT), shlex.join(cmd))
    try:
        wait_pane(session, lambda p: "Enter send" in p and "loaded" in p, timeout=300)
        tmux("send-keys", "-t", session, "-l", "What is the capital of France?")
        tmux("send-keys", "-t", session, "Enter")
        pane = wait_pane(session, lambda p: "done ·" in p, timeout=300)
        assert "Paris" in pane
        lines = pane.splitlines()
        actual = next(line for line in lines if "actual " in line and "allocated" in line)
        predicted = next(line for line in lines if "predicted " in line and "allocated" in line)
        assert "MiB" in actual and "MiB" in predicted
        assert "exact" in pane
        figure = actual.split("actual", 1)[1].split("allocated")[0].strip()
        assert figure in predicted  # the same number on both lines
        turn = json.loads(metrics.read_text())["turns"][-1]
        assert turn["kv_bytes_actual"] == turn["kv_bytes_predicted"] > 0
        tmux("send-keys", "-t", session, "C-q")
        time.sleep(1.0)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
