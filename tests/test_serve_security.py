"""``mlxkv serve`` with an API key, a small body limit, two rows and more model names:
authentication, 413, 429, refusing to listen where it should not, the names clients send,
and SIGTERM while answers stream."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serve_helpers import COUNTING, ROOT, Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model
KEY = "sk-test-1234"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(
        tmp_path_factory.mktemp("serve-secure"),
        "--max-body",
        "4096",
        "--max-batch",
        "2",
        "--max-queue",
        "0",
        "--shutdown-timeout",
        "8",  # what SIGTERM leaves the short answer (8 tokens) to finish in
        "--kv-bits",
        "4",  # the server's default policy
        "--served-model-name",
        "local-chat",
        "--served-model-name",
        "claude-*",
        env={"MLXKV_API_KEY": KEY},
        key=KEY,
    )
    yield s
    s.stop()


def serve_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "MLXKV_API_KEY"}
    return subprocess.run(
        [sys.executable, "-m", "mlxkv", "serve", *args],
        capture_output=True,
        text=True,
        env={**full, **(env or {})},
        cwd=ROOT,
        timeout=120,
    )


def test_a_public_address_needs_a_key():
    r = serve_cli("--host", "0.0.0.0")
    assert r.returncode == 2
    assert r.stderr == (
        "mlxkv serve: error: --host 0.0.0.0 would let other machines in without a key; "
        "set --api-key KEY (or MLXKV_API_KEY) or listen on 127.0.0.1\n"
    )


def test_a_busy_port_is_refused_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = serve_cli("--port", str(port))
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == (
        f"mlxkv serve: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
        "pick another --port"
    )
    assert "loading weights" not in r.stderr


def test_the_key_is_required(server):
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # no header at all
    for headers in (
        {"Authorization": ""},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
    ):
        r = server.http("GET", "/v1/models", headers=headers)
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key"
        assert "Authorization: Bearer KEY" in err["message"]
        r = server.http("POST", "/v1/chat/completions", headers=headers, json={"messages": MSG})
        assert r.status_code == 401
    assert server.http("GET", "/health", headers={"Authorization": ""}).status_code == 200
    assert server.http("GET", "/", headers={"Authorization": ""}).status_code == 200
    for method, path in (  # every API's endpoints, each answering in its own error shape
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/v1/messages"),
        ("POST", "/api/chat"),
        ("POST", "/api/generate"),
        ("GET", "/api/tags"),
        ("POST", "/api/show"),
        ("GET", "/v1/files"),
        ("POST", "/v1/batches"),
    ):
        r = server.http(method, path, headers={"Authorization": "Bearer wrong"}, json={})
        assert r.status_code == 401, path
        body = r.json()
        message = body["error"] if path.startswith("/api/") else body["error"]["message"]
        assert "with the key the server was started with" in message, path
    with pytest.raises(openai.AuthenticationError):
        server.client(key="sk-wrong").models.list()
    r = server.client().chat.completions.create(
        model="smollm2-135m", messages=MSG, max_tokens=2, temperature=0
    )
    assert r.usage.completion_tokens == 2
    assert r.usage.model_extra["mlxkv"]["policy"] == "full, 4-bit (group 64), kivi keys"
    assert server.status()["policy"] == "full, 4-bit (group 64), kivi keys"


def test_with_a_key_any_page_may_call_the_api_with_it(server):
    """The key guards the server, so CORS lets any page's script send it."""
    ask = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    origin = "https://chat.example"
    r = server.http("OPTIONS", "/v1/chat/completions", headers={"Origin": origin, **ask})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    r = server.http("GET", "/v1/models", headers={"Origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": origin})  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_anthropics_clients_send_the_key_as_x_api_key(server):
    """Anthropic's SDKs send "x-api-key: KEY": the key is taken there too, and a wrong
    one is refused in Anthropic's error shape on /v1/messages."""
    import anthropic

    url = server.url
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="smollm2-135m", max_tokens=2, messages=MSG
        )
    assert e.value.status_code == 401
    assert e.value.body["error"]["type"] == "authentication_error"
    assert "'x-api-key: KEY'" in e.value.body["error"]["message"]
    r = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
        model="smollm2-135m", max_tokens=2, messages=MSG
    )
    assert r.usage.output_tokens == 2 and r.stop_reason == "max_tokens"
    assert server.http("GET", "/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_more_model_names_are_answered_under_the_first(server):
    """--served-model-name local-chat, then 'claude-*': the first plain name is the id listed and
    answered with; the pattern takes the names an agent sends; the model's own names still
    answer; any other name is a 404 that says how to add one."""
    import anthropic
    import ollama

    client = server.client()
    assert [m.id for m in client.models.list().data] == ["local-chat"]
    for name in ("local-chat", "smollm2-135m"):
        r = client.chat.completions.create(model=name, messages=MSG, max_tokens=2)
        assert r.model == "local-chat"
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    r = claude.messages.create(model="claude-haiku-4-5-20251001", max_tokens=2, messages=MSG)
    assert (r.model, r.usage.output_tokens) == ("local-chat", 2)
    local = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})
    assert local.chat(model="local-chat:latest", messages=MSG, options={"num_predict": 2}).done
    assert [m.model for m in local.list().models] == ["local-chat"]
    r = server.http("POST", "/v1/chat/completions", json={"model": "gpt-4o", "messages": MSG})
    assert (r.status_code, r.json()["error"]["message"]) == (
        404,
        "The model 'gpt-4o' does not exist on this server: it serves 'local-chat' "
        "(GET /v1/models); the model is chosen when mlxkv serve starts (--served-model-name "
        "gives it more names)",
    )


@pytest.mark.parametrize("name", ["", " padded", "tab\there"])
def test_a_served_name_that_no_client_could_send_is_refused(name):
    r = serve_cli("--served-model-name", "ok", "--served-model-name", name)
    assert r.returncode == 2
    assert r.stderr == (
        f"mlxkv serve: error: --served-model-name {name!r}: a name is 1 to 256 printable "
        "characters, without spaces at either end\n"
    )


def test_a_body_over_the_limit_gets_413(server):
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = server.http("POST", "/v1/chat/completions", json=big)
    assert r.status_code == 413
    assert r.json()["error"]["message"] == (
        "the request body is larger than this server takes (4096 bytes, --max-body)"
    )

    def chunks():  # no Content-Length: the server counts what arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    r = server.http("POST", "/v1/completions", content=chunks())
    assert r.status_code == 413


def test_past_the_rows_and_queue_a_request_gets_429(server):
    client = server.client()
    stream = client.completions.create(  # n=2 takes both rows
        model="smollm2-135m", prompt=COUNTING, max_tokens=4000, temperature=0, n=2, stream=True
    )
    next(iter(stream))
    r = server.http("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "2 answers are running or queued" in r.json()["error"]["message"]
    stream.close()
    server.wait_idle()
    r = server.http("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200


def test_a_batch_runs_under_the_key_and_waits_out_a_full_server(server):
    """The batch's requests carry the server's key; one the server is too busy for (both
    rows taken, no queue) is sent again until it runs."""
    client = server.client()
    stream = client.completions.create(
        model="smollm2-135m", prompt=COUNTING, max_tokens=4000, temperature=0, n=2, stream=True
    )
    next(iter(stream))
    refused = server.status()["refused"]["busy"]
    line = {"method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}
    data = b"".join(json.dumps({"custom_id": c, **line}).encode() + b"\n" for c in "ab")
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    time.sleep(2.5)
    assert client.batches.retrieve(batch.id).request_counts.completed == 0
    assert server.status()["refused"]["busy"] >= refused + 2  # asked again, a second apart
    stream.close()
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert (batch.request_counts.completed, batch.error_file_id) == (2, None)
    got = client.files.content(batch.output_file_id).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in got) == ["a", "b"]


def test_sigterm_lets_answers_finish_then_cuts_the_rest(server):
    """The last test of the module: it stops the server."""
    events: dict[str, list[str]] = {"short": [], "long": []}
    started = {k: threading.Event() for k in events}

    def read(name: str, max_tokens: int) -> None:
        body = {"prompt": COUNTING, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line:
                    events[name].append(line)
                    started[name].set()

    threads = [
        threading.Thread(target=read, args=("short", 8)),
        threading.Thread(target=read, args=("long", 4000)),
    ]
    for t in threads:
        t.start()
    assert all(e.wait(300) for e in started.values())
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # the listening socket closes at once
        try:
            httpx.get(f"{server.url}/health", timeout=1)
        except httpx.TransportError:
            break
        assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
        time.sleep(0.2)
    for t in threads:
        t.join(120)
    assert server.proc.wait(120) == 0
    assert events["short"][-1] == "data: [DONE]"
    last = json.loads(events["short"][-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    cut = json.loads(events["long"][-1][6:])
    assert cut["error"]["code"] == "shutting_down"
    assert cut["error"]["message"].startswith("the server is shutting down; this answer was cut")
    assert server.log().rstrip().endswith("mlxkv: server stopped")
    assert "Traceback" not in server.log()


def _no_answer_fits(*flags: str) -> str:
    r = serve_cli("--port", "0", "--memory", "1MB", *flags)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_a_budget_where_no_answer_fits_is_refused_at_start():
    """--memory 1MB started a server that refused every request (400, blaming max_tokens)."""
    line = _no_answer_fits()
    assert line.startswith(
        "mlxkv serve: error: --memory 1MB leaves 0 MiB for the KV cache after the weights "
        "(0.50 GiB) and runtime ("
    )
    assert "less than the first 512 tokens of an answer need (34 MiB, full)" in line
    assert line.endswith("raise --memory to at least 1.25GiB")
    line = _no_answer_fits("--max-tokens", "600")
    assert "less than one answer of --max-tokens 600 needs (34 MiB, full)" in line
    assert line.endswith("GiB, or lower --max-tokens")


@pytest.mark.slow
def test_the_budget_the_refusal_names_is_enough(tmp_path):
    enough = _no_answer_fits().split("raise --memory to at least ")[1].split(",")[0]
    server = Server(tmp_path, "--memory", enough)
    try:
        r = server.http("POST", "/v1/completions", json={"prompt": "Hi"})  # max_tokens left out
        assert r.status_code == 200, r.text
    finally:
        server.stop()
