"""Measure the chat UI: first paint after load, key latency while streaming, and what the
UI costs decoding (engine tok/s with the UI in a real terminal vs ``mlxkv generate``).

    python -m benchmarks.tui_measure --runs 3 --tokens 64

Runs ``mlxkv chat`` inside tmux (real terminal rendering) and ``mlxkv generate --json``
alternately, with the same greedy prompt, and prints JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

PROMPT = "Write a short story about a robot who learns to paint."


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def _wait(condition, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


def raw_tps(tokens: int) -> float:
    cmd = [sys.executable, "-m", "mlxkv", "generate", "--json", "--max-tokens", str(tokens)]
    out = subprocess.run([*cmd, "-p", PROMPT], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["generation_tps"]


class TmuxChat:
    def __init__(self, tokens: int, width: int = 140, height: int = 45):
        self.session = f"mlxkv-measure-{uuid.uuid4().hex[:6]}"
        self.metrics = Path(tempfile.mkdtemp()) / "metrics.json"
        cmd = [sys.executable, "-m", "mlxkv", "chat", "--max-tokens", str(tokens)]
        cmd += ["--metrics", str(self.metrics)]
        _tmux("new-session", "-d", "-s", self.session, "-x", str(width), "-y", str(height))
        _tmux("send-keys", "-t", self.session, shlex.join(cmd), "Enter")
        _wait(lambda: self.read().get("first_paint_after_load") is not None, 300, "load")

    def read(self) -> dict:
        try:
            return json.loads(self.metrics.read_text())
        except (OSError, ValueError):
            return {}

    def turn(self, keys_while_streaming: str = "abc") -> dict:
        n = len(self.read().get("turns", []))
        _tmux("send-keys", "-t", self.session, "-l", PROMPT)
        _tmux("send-keys", "-t", self.session, "Enter")
        time.sleep(2.0)  # well into decoding: type while tokens stream in
        for ch in keys_while_streaming:
            _tmux("send-keys", "-t", self.session, "-l", ch)
            time.sleep(0.2)
        for _ in keys_while_streaming:
            _tmux("send-keys", "-t", self.session, "BSpace")
        data = _wait(lambda: len(self.read().get("turns", [])) > n and self.read(), 600, "turn")
        _tmux("send-keys", "-t", self.session, "-l", "/clear")
        _tmux("send-keys", "-t", self.session, "Enter")
        time.sleep(1.0)
        return data

    def close(self) -> None:
        _tmux("send-keys", "-t", self.session, "C-q")
        time.sleep(1.0)
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    chat = TmuxChat(args.tokens)
    raw, ui, share = [], [], []
    try:
        for _ in range(args.runs):
            raw.append(raw_tps(args.tokens))
            turn = chat.turn()["turns"][-1]
            ui.append(turn["generation_tps"])
            share.append(turn.get("ui_cpu_share"))
        data = chat.read()
    finally:
        chat.close()
    raw_med, ui_med = statistics.median(raw), statistics.median(ui)
    result = {
        "tokens": args.tokens,
        "raw_tps": raw,
        "ui_tps": ui,
        "raw_median": raw_med,
        "ui_median": ui_med,
        "ui_cost_percent": 100 * (raw_med - ui_med) / raw_med,
        "ui_cpu_share_percent": [round(100 * x, 2) for x in share if x is not None],
        "load_seconds": data.get("load_seconds"),
        "first_paint_after_load_seconds": data.get("first_paint_after_load"),
        "key_latency_ms": data.get("key_latency_ms"),
        "panel_renders": data.get("panel_renders"),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
