"""What a client gets when the server stops in ways the drain does not cover: a second
Ctrl+C (uvicorn offers it to "force quit") and a client still sending its body when the
shutdown timeout ends. Each was a traceback in the log and a bare text/plain 500."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.serve_helpers import COUNTING, Server

pytestmark = pytest.mark.model


def test_a_second_ctrl_c_cuts_the_answers_at_once_each_with_its_error(tmp_path):
    server = Server(tmp_path, "--shutdown-timeout", "600")  # the drain alone would wait
    lines: list[str] = []
    begun = threading.Event()

    def read() -> None:
        body = {"prompt": COUNTING, "max_tokens": 4000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    begun.set()

    t = threading.Thread(target=read)
    t.start()
    assert begun.wait(300)
    server.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 120
    while "Waiting for connections to close" not in server.log():  # the first one is taken
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    server.proc.send_signal(signal.SIGINT)
    t.join(300)
    assert server.proc.wait(300) == 0
    assert lines[-1].startswith('data: {"error"'), lines[-3:]
    cut = json.loads(lines[-1][len("data: ") :])
    assert cut["error"]["code"] == "shutting_down"
    assert cut["error"]["message"].startswith("the server is shutting down; this answer was cut")
    said = r"mlxkv: cmpl-\w+ 503: the server is shutting down; this answer was cut after \d+ "
    assert re.search(said, server.log()), server.log()
    assert "Traceback" not in server.log() and " 500 " not in server.log()
    server.stop()


def test_a_client_still_sending_its_body_at_the_deadline_gets_a_503(tmp_path):
    server = Server(tmp_path, "--shutdown-timeout", "1")
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=120) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 60\r\n\r\n{"messa'
        )
        server.http("GET", "/health")  # the partial request has reached the app
        server.proc.send_signal(signal.SIGTERM)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"content-type: application/json" in head.lower()
    assert json.loads(body) == {
        "error": {
            "message": "the server is shutting down",
            "type": "server_error",
            "param": None,
            "code": "shutting_down",
        }
    }
    assert server.proc.wait(120) == 0
    assert "Traceback" not in server.log()
    server.stop()


@pytest.mark.slow
def test_a_body_that_stops_arriving_gets_408(tmp_path):
    """A client that sent its headers and a few bytes held its connection open for ever."""
    from mlxkv.server.gate import BODY_WAIT

    server = Server(tmp_path)
    url = urlsplit(server.url)
    try:
        with socket.create_connection((url.hostname, url.port), timeout=BODY_WAIT + 60) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b'Content-Type: application/json\r\nContent-Length: 60\r\n\r\n{"messa'
            )
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        head, body = reply.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body)["error"] == {
            "message": f"the request body stopped arriving (nothing for {BODY_WAIT:g} s); send "
            "it whole",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
        assert server.http("GET", "/health").status_code == 200
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log()


@pytest.mark.slow  # four servers started
def test_a_sigterm_as_soon_as_the_server_says_it_serves_exits_0(tmp_path):
    """The 'serving ... on http://...' line comes once a signal drains the server: a
    supervisor stopping it the moment it reads the line gets status 0, not the signal's
    (-15); four tries, as the moment varies."""
    codes = []
    for i in range(4):
        s = Server(tmp_path / str(i))
        codes.append(s.stop())
        assert "Traceback" not in s.log(), s.log()
    assert codes == [0, 0, 0, 0]
