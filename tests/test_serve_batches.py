"""OpenAI's Files and Batch APIs on a real ``mlxkv serve``, through the official client: a
file of requests uploaded, a batch run on it, its output and error files read back; the
batch's answers are the ones the same requests get one at a time."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.serve_helpers import Server, serving

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model
QUESTIONS = ["What is the capital of France?", "Name a color.", "Say hi.", "Count to three."]
ENDED = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("batches"))


def chat_line(custom_id: str, question: str, max_tokens: int = 12, **more) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {**body, "temperature": 0, **more},
    }


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def run_batch(client, data: bytes, endpoint: str = "/v1/chat/completions"):
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h"
    )
    return uploaded, ended(client, batch)


def ended(client, batch, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while batch.status not in ENDED:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return batch


def records(client, file_id: str) -> dict[str, dict]:
    lines = client.files.content(file_id).text.splitlines()
    out = {}
    for line in lines:
        record = json.loads(line)
        out[record["custom_id"]] = record
    assert len(out) == len(lines)  # one record per request
    return out


def test_a_batch_answers_as_the_requests_one_at_a_time(server):
    client = server.client()
    lines = [chat_line(f"q{i}", q) for i, q in enumerate(QUESTIONS)]
    lines.append(chat_line("wrong-model", "Hi", model="gpt-9"))
    data = jsonl(lines)
    uploaded, batch = run_batch(client, data)

    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (5, 4)
    assert batch.request_counts.failed == 1
    assert batch.model == server.model and batch.errors is None
    assert client.files.content(uploaded.id).content == data  # the upload, byte for byte
    assert client.files.retrieve(uploaded.id).bytes == len(data)

    answered = records(client, batch.output_file_id)
    assert sorted(answered) == ["q0", "q1", "q2", "q3"]
    usage = {"input_tokens": 0, "output_tokens": 0}
    for i, q in enumerate(QUESTIONS):
        record = answered[f"q{i}"]
        assert record["id"].startswith("batch_req_") and record["error"] is None
        assert record["response"]["status_code"] == 200
        body = record["response"]["body"]
        alone = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": q}],
            max_tokens=12,
            temperature=0,
        )
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
        usage["input_tokens"] += body["usage"]["prompt_tokens"]
        usage["output_tokens"] += body["usage"]["completion_tokens"]
    assert batch.usage.input_tokens == usage["input_tokens"]
    assert batch.usage.output_tokens == usage["output_tokens"]
    assert batch.usage.total_tokens == sum(usage.values())

    (refused,) = records(client, batch.error_file_id).values()
    assert refused["custom_id"] == "wrong-model"
    assert refused["response"]["status_code"] == 404
    assert refused["response"]["body"]["error"]["code"] == "model_not_found"

    output = client.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output"
    assert output.filename == f"{batch.id}_output.jsonl"
    listed = [f.id for f in client.files.list()]
    assert {uploaded.id, batch.output_file_id, batch.error_file_id} <= set(listed)
    assert batch.id in [b.id for b in client.batches.list()]


def test_an_embeddings_batch_gives_the_vectors_of_the_requests_alone(server):
    client = server.client()
    texts = ["The capital of France is Paris.", "Bonjour"]
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": t}}
        for i, t in enumerate(texts)
    ]
    _, batch = run_batch(client, jsonl(lines), "/v1/embeddings")
    assert batch.status == "completed" and batch.request_counts.completed == 2
    answered = records(client, batch.output_file_id)
    for i, text in enumerate(texts):
        alone = client.embeddings.create(model=server.model, input=text).data[0].embedding
        got = answered[f"e{i}"]["response"]["body"]["data"][0]["embedding"]
        assert got == pytest.approx(alone, abs=1e-4)  # inputs may share a call: other sums
    assert batch.usage.input_tokens == sum(
        answered[f"e{i}"]["response"]["body"]["usage"]["prompt_tokens"] for i in range(2)
    )


def test_an_input_the_batch_cannot_run_fails_it_with_each_line_named(server):
    client = server.client()
    lines = [
        chat_line("a", "Hi"),
        b"{not json",
        chat_line("a", "Hi again"),
        {**chat_line("b", "Hi"), "url": "/v1/completions"},
        chat_line("c", "Hi", stream=True),
        {**chat_line("d", "Hi"), "method": "GET"},
        {"custom_id": "e", "method": "POST", "url": "/v1/chat/completions"},
    ]
    _, batch = run_batch(client, jsonl(lines))

    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.output_file_id is None and batch.error_file_id is None
    got = [(e.line, e.code, e.message) for e in batch.errors.data]
    assert got == [
        (2, "invalid_json_line", "line 2 is not a JSON object"),
        (
            3,
            "duplicate_custom_id",
            "line 3: custom_id 'a' is on an earlier line; each request needs its own",
        ),
        (
            4,
            "mismatched_endpoint",
            "line 4: url '/v1/completions' is not the batch's endpoint /v1/chat/completions",
        ),
        (
            5,
            "invalid_body",
            "line 5: body.stream is not taken in a batch (its answer is its record)",
        ),
        (6, "invalid_method", 'line 6: method must be "POST"'),
        (7, "invalid_body", "line 7: body must be the request's object"),
    ]
    _, empty = run_batch(client, b"\n\n")
    assert [(e.code, e.message) for e in empty.errors.data] == [
        ("empty_file", "the input file holds no request lines")
    ]


def test_bad_file_and_batch_requests_are_refused_with_a_reason(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert (
        e.value.body["message"] == "purpose must be 'batch' (the input of a batch), got 'fine-tune'"
    )
    r = server.http("POST", "/v1/files", json={"purpose": "batch"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "send the file as multipart/form-data, with the fields 'file' and 'purpose'"
    )
    r = server.http("POST", "/v1/files", data={"purpose": "batch"}, files={"other": b"x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: other"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(
            file=("x.jsonl", b"{}\n"),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 31 * 86400},
        )
    assert e.value.body["message"] == (
        "expires_after.seconds must be a whole number of seconds from 3600 (1 hour) to 2592000 "
        "(30 days), got 2678400"
    )
    for seconds in ("\u00b2", "9" * 5000, "-3600", "3600.0"):  # a form's text, not a number
        form = {"purpose": "batch", "expires_after[anchor]": "created_at"}
        form["expires_after[seconds]"] = seconds
        r = server.http("POST", "/v1/files", data=form, files={"file": b"{}\n"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "expires_after.seconds"
    form = {"purpose": "batch", "expires_after[seconds]": "3600"}
    r = server.http("POST", "/v1/files", data=form, files={"file": b"{}\n"})
    assert r.json()["error"]["message"] == "expires_after.anchor must be 'created_at'"

    uploaded = client.files.create(
        file=("in.jsonl", jsonl([chat_line("a", "Hi")])), purpose="batch"
    )
    cases = [
        (
            {"endpoint": "/v1/moderations"},
            "endpoint must be one of /v1/chat/completions, "
            "/v1/completions, /v1/embeddings, /v1/responses",
        ),
        ({"completion_window": "1h"}, "completion_window must be '24h'"),
        (
            {"input_file_id": "file-000000000000000000000000"},
            "input_file_id names no file on "
            "this server: 'file-000000000000000000000000' (upload it with POST /v1/files, purpose "
            "'batch')",
        ),
        (
            {"input_file_id": "../../etc/passwd"},
            "input_file_id names no file on this server: "
            "'../../etc/passwd' (upload it with POST /v1/files, purpose 'batch')",
        ),
        (
            {"output_expires_after": {"anchor": "created_at", "seconds": 60}},
            "output_expires_after.seconds must be a whole number of seconds from 3600 (1 hour) "
            "to 2592000 (30 days), got 60",
        ),
        (
            {"output_expires_after": {"anchor": "last_active_at", "seconds": 3600}},
            "output_expires_after.anchor must be 'created_at'",
        ),
    ]
    for change, message in cases:
        body = {
            "input_file_id": uploaded.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **change,
        }
        r = server.http("POST", "/v1/batches", json=body)
        assert (r.status_code, r.json()["error"]["message"]) == (400, message)

    r = server.http("GET", "/v1/files/file-000000000000000000000000/content")
    assert (r.status_code, r.json()["error"]["message"]) == (
        404,
        "No such File object: file-000000000000000000000000",
    )
    for name in ("..%2F.lock", ".lock", "file-0.json"):  # nothing but a file's own name reads
        r = server.http("GET", f"/v1/files/{name}/content")
        assert r.status_code == 404 and "error" in r.json()
    r = server.http("GET", "/v1/batches/batch_nope")
    assert (r.status_code, r.json()["error"]["message"]) == (
        404,
        "No batch found with id 'batch_nope'",
    )
    client.files.delete(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_files_expire_when_asked_and_uploads_after_30_days(server):
    """As OpenAI's API: an upload expires 30 days after it is made unless it says when
    (``expires_after``), a batch's output file when ``output_expires_after`` says; by
    default it stays."""
    client = server.client()
    data = jsonl([chat_line("a", "Say hi.", max_tokens=2)])
    plain = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert plain.expires_at == plain.created_at + 30 * 86400
    hour = {"anchor": "created_at", "seconds": 3600}
    short = client.files.create(file=("in.jsonl", data), purpose="batch", expires_after=hour)
    assert short.expires_at == short.created_at + 3600
    assert client.files.retrieve(short.id).expires_at == short.expires_at

    kept = ended(
        client,
        client.batches.create(
            input_file_id=plain.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    )
    assert kept.status == "completed"
    assert client.files.retrieve(kept.output_file_id).expires_at is None
    day = {"anchor": "created_at", "seconds": 86400}
    going = ended(
        client,
        client.batches.create(
            input_file_id=short.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after=day,
        ),
    )
    assert going.status == "completed" and going.output_expires_after == day
    output = client.files.retrieve(going.output_file_id)
    assert output.purpose == "batch_output"
    assert output.expires_at == output.created_at + 86400


def test_an_upload_larger_than_the_limit_is_refused_before_it_is_read(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: multipart/form-data; boundary=x\r\n"
            b"Content-Length: 300000000\r\n\r\n"
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, answer
            answer += chunk
    head, body = answer.decode().split("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413")
    assert json.loads(body)["error"] == {
        "message": "the file is larger than this server takes (200,000,000 bytes, OpenAI's "
        "limit for a batch's input): split it into smaller batches",
        "type": "invalid_request_error",
        "param": "file",
        "code": "file_too_large",
    }


def test_a_cancelled_batch_stops_and_its_file_can_then_go(server):
    client = server.client()
    lines = [chat_line(f"long{i}", f"Write a story about the number {i}.", 300) for i in range(40)]
    uploaded = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "in_progress"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.delete(uploaded.id)
    assert e.value.body["code"] == "file_in_use"
    assert e.value.body["message"] == (
        f"the file is in use by {batch.id} (in_progress): cancel the batch or let it end first"
    )
    running = server.status()["batches"]
    assert running["running"] == {"id": batch.id, "total": 40, "completed": 0, "failed": 0}
    assert running["requests_in_flight"] == 15  # --max-batch minus one: a row for a client
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    batch = ended(client, cancelled)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts.completed + batch.request_counts.failed < 40
    server.wait_idle()  # no request of the batch is left running
    assert server.status()["batches"]["running"] is None
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.cancel(batch.id)
    assert (
        e.value.body["message"]
        == "the batch has ended (cancelled); only a running one is cancelled"
    )
    assert client.files.delete(uploaded.id).deleted


@pytest.mark.slow
def test_a_batch_goes_on_after_the_server_is_killed(tmp_path):
    """kill -9 mid-batch: the next server on the same folder runs the requests that have no
    record yet, and each request ends with one record, its answer the one-at-a-time one."""
    folder = str(tmp_path / "files")
    first = Server(tmp_path / "a", "--files-dir", folder)
    lines = [chat_line(f"q{i}", f"Tell me about the number {i}.", 24) for i in range(24)]
    try:
        client = first.client()
        uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while client.batches.retrieve(batch.id).request_counts.completed < 4:
            time.sleep(0.1)
    finally:
        first.proc.kill()
        first.stop()
    second = Server(tmp_path / "b", "--files-dir", folder)
    try:
        assert f"batches: {batch.id} goes on from the records its files hold" in second.log()
        client = second.client()
        batch = ended(client, client.batches.retrieve(batch.id))
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (24, 0)
        answered = records(client, batch.output_file_id)
        assert sorted(answered) == sorted(line["custom_id"] for line in lines)
        for line in lines[:3] + lines[-3:]:
            alone = client.chat.completions.create(model=batch.model, **line["body"])
            body = answered[line["custom_id"]]["response"]["body"]
            assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
        third = Server(tmp_path / "c", "--files-dir", folder)  # the folder is the second's
        try:
            assert (
                f"files: {folder} is in use by another mlxkv server: this server runs no "
                "batches (give it a --files-dir of its own to run them)"
            ) in third.log()
            r = third.http("GET", "/v1/files")
            assert (r.status_code, r.json()["error"]["code"]) == (404, "files_off")
        finally:
            assert third.stop() == 0
    finally:
        assert second.stop() == 0
    assert "Traceback" not in second.log()
