"""``mlxkv generate`` shows prompt reading progress in a terminal, and only there."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest

PROMPT = "Count the words in this sentence please. " * 12  # ~100 tokens
ARGS = ["generate", "--raw", "--prompt", PROMPT, "--max-tokens", "2", "--prefill-step", "16"]


def _run(extra=()):
    """``mlxkv generate`` with its stderr on a terminal (a pty)."""
    cmd = [sys.executable, "-m", "mlxkv", *ARGS, *extra]
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    out = p.stdout.read()
    p.wait(timeout=600)
    os.close(master)
    return p.returncode, out, err.decode()


@pytest.mark.model
def test_progress_bar_in_a_terminal_is_cleared_before_the_answer(default_model_path):
    code, out, err = _run()
    assert code == 0, err
    assert "reading the prompt [" in err and "tokens" in err
    # The last bar drawn is erased before the answer streams.
    assert err.rfind("\r\x1b[K") > err.rfind("reading the prompt")


@pytest.mark.model
@pytest.mark.slow  # (CI checks the bar in a terminal and none on a pipe)
def test_no_progress_when_json_in_a_terminal(default_model_path):
    code, out, err = _run(("--json",))
    assert code == 0, err
    assert "reading the prompt" not in err


@pytest.mark.model
def test_no_progress_when_piped(cli, preloaded):
    """stderr that is not a terminal (captured here, as a pipe would be): no bar."""
    out = cli(*ARGS)
    assert out.returncode == 0, out.stderr
    assert "reading the prompt" not in out.stderr and out.stdout
