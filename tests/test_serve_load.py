"""A bounded load test: 64 streaming clients on loopback for 60 seconds. Every stream ends
complete with ``[DONE]`` or with a clean OpenAI-shaped error, nothing answers 5xx, and the
server still answers afterwards."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.serve_proc import Server

pytestmark = [pytest.mark.model, pytest.mark.slow]
CLIENTS = 64
SECONDS = 60


def test_sixty_four_streaming_clients_for_a_minute(tmp_path):
    server = Server(tmp_path, "--max-queue", "32")  # 16 rows + 32 waiting: some get 429
    outcomes: list[str] = []
    problems: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + SECONDS

    def client(i: int) -> None:
        k = 0
        with httpx.Client(timeout=300) as http:
            while time.monotonic() < stop_at:
                k += 1
                kv = {"window": 32, "sinks": 4} if i % 4 == 0 else None
                body = {
                    "messages": [{"role": "user", "content": f"Count from {i} to {i + k}."}],
                    "max_tokens": 8 + (i + k) % 24,
                    "stream": True,
                    **({"kv": kv} if kv else {}),
                }
                outcome = one_stream(http, body)
                with lock:
                    outcomes.append(outcome)
                    if outcome.startswith("bad"):
                        problems.append(outcome)
                if outcome == "429":
                    time.sleep(1)

    def one_stream(http: httpx.Client, body: dict) -> str:
        try:
            with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    err = r.json().get("error", {})
                    ok = r.status_code in (429, 503) and err.get("message")
                    return str(r.status_code) if ok else f"bad status {r.status_code}: {r.text}"
                lines = [line for line in r.iter_lines() if line]
        except httpx.HTTPError as e:
            return f"bad transport: {e!r}"
        if lines and lines[-1] == "data: [DONE]":
            return "done"
        last = json.loads(lines[-1][6:]) if lines else {}
        if "error" in last and last["error"].get("message"):
            return "error event"
        return f"bad stream end: {lines[-3:]}"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(SECONDS + 600)
        assert not problems, problems[:5]
        assert outcomes.count("done") > 0
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        r = server.client().chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert r.usage.completion_tokens == 3
        assert server.wait_idle()["max_rows_in_a_step"] > 1  # answers were batched
    finally:
        code = server.stop()
    assert code == 0
    assert "Traceback" not in server.log()
    print({o: outcomes.count(o) for o in set(outcomes)})
