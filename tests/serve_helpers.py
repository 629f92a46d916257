"""A real ``mlxkv serve`` process for tests: started on 127.0.0.1 with ``--port 0`` and
stopped with SIGTERM; shared by the serve test modules."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9,"  # greedy raw completion keeps counting: no early EOS


class Server:
    """``mlxkv serve --port 0 FLAGS`` in a subprocess; its log goes to a file."""

    def __init__(
        self,
        tmp: Path,
        *flags: str,
        env: dict | None = None,
        key: str | None = None,
        launcher: list[str] | None = None,  # e.g. mlx.launch -n 2 --: the server's ranks
    ):
        tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "server.log"
        # the prefix cache's, the conversations', the stored responses' and the uploads'
        # files stay in the test's folder unless the test names one
        own_files = [] if "--prefix-cache-dir" in flags else ["--prefix-cache-dir", str(tmp / "pc")]
        for flag, folder in (
            ("--conversation-dir", "conversations"),
            ("--responses-dir", "responses"),
            ("--files-dir", "files"),
        ):
            if flag not in flags:
                own_files += [flag, str(tmp / folder)]
        self.launcher = launcher
        self.key = key
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*(launcher or []), sys.executable, "-m", "mlxkv", "serve", "--port", "0", *flags]
            + own_files,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
            start_new_session=launcher is not None,  # the ranks stop as a terminal's group
            # mlx.launch's stdin open, as a terminal's: at its end (pytest's /dev/null) the
            # launcher's loop re-queues empty reads without pause, and a Ctrl+C landing in
            # Queue.put leaves the lock held and the launcher hung after its ranks stopped
            # (docs/distributed.md, "Stopping")
            stdin=subprocess.PIPE if launcher is not None else None,
        )
        deadline = time.monotonic() + 600
        while True:
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", self.log())
            if found:
                self.url = found.group(1)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"mlxkv serve did not start:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text()

    def client(self, key: str | None = None):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key or self.key or "none", max_retries=0, timeout=600
        )

    def http(self, method: str, path: str, **kw) -> httpx.Response:
        headers = kw.pop("headers", {})
        if self.key and "authorization" not in {k.lower() for k in headers}:
            headers["Authorization"] = f"Bearer {self.key}"
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=600, **kw)

    def status(self) -> dict:
        return self.http("GET", "/v1/status").json()

    def wait_idle(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.status()
            if not s["running"] and not s["waiting"] and not s["rows_in_flight"]:
                return s
            assert time.monotonic() < deadline, s
            time.sleep(0.1)

    def stop(self) -> int | None:
        if self.launcher is not None:  # the launcher and its ranks: a terminal's Ctrl+C
            return self._stop_group()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def _stop_group(self) -> int | None:
        group = self.proc.pid
        try:
            os.killpg(group, signal.SIGINT)
            self.proc.wait(120)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        deadline = time.monotonic() + 60
        while group_members(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in group_members(group):  # never leave a rank behind
            os.kill(pid, signal.SIGKILL)
        self.proc.stdin.close()
        self._log.close()
        return self.proc.returncode


def group_members(group: int) -> list[int]:
    """The pids of the live processes in process group ``group`` (Linux's /proc; a zombie,
    exited and not yet reaped by its parent, is not live)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, _, pgrp = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if int(pgrp) == group and state != "Z":
            pids.append(int(pid))
    return pids


def serving(tmp: Path, *flags: str) -> Iterator[Server]:
    """A module fixture's server: yielded to its tests (with ``model``, the id it serves),
    then stopped, and it must have exited 0 without a traceback."""
    s = Server(tmp, *flags)
    s.model = s.http("GET", "/v1/models").json()["data"][0]["id"]
    yield s
    code = s.stop()
    assert code == 0, s.log()
    assert "Traceback" not in s.log(), s.log()


def named_events(server: Server, path: str, body: dict) -> list[tuple[str, dict]]:
    """A stream of named server-sent events (Anthropic's, the Responses API's) as (event
    name, data); each data's ``type`` is its event's name."""
    out = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=600) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name
                out.append((name, data))
    return out


def cut_by_shutdown(server: Server, path: str, body: dict, started: str) -> list[str]:
    """The lines of a stream still running when the server is stopped (SIGTERM, once the
    line ``started`` came); the server must exit 0."""
    lines: list[str] = []
    begun = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if line == started:
                        begun.set()

    stop_during(server, read, begun)
    return lines


def stop_during(server: Server, read, begun: threading.Event) -> None:
    """Run ``read`` in a thread and stop the server (SIGTERM) once ``begun`` is set; the
    reader must end and the server exit 0."""
    t = threading.Thread(target=read)
    t.start()
    assert begun.wait(300)
    server.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert server.proc.wait(120) == 0
