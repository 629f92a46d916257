"""A real ``mlxkv serve`` process for the server tests, reached with the official ``openai``
client or raw HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9,"  # greedy raw completion keeps counting: no early EOS


class Server:
    """``mlxkv serve --port 0 FLAGS`` in a subprocess; its log goes to a file."""

    def __init__(self, tmp: Path, *flags: str, env: dict | None = None, key: str | None = None):
        self.log_path = tmp / "server.log"
        self.key = key
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxkv", "serve", "--port", "0", *flags],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
