"""The batch runner and the file store on their own: a batch's records written once each
(a request the server was too busy for asked again, one a shutdown cut asked at the next
start, a torn record dropped), and a folder's stray or crafted files left alone. The real
server's batches: tests/test_serve_batches.py."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from mlxkv.server import batch_runner
from mlxkv.server.batch_runner import BatchRunner, Send, check_input, new_batch
from mlxkv.server.file_store import FileStore

URL = "/v1/completions"


class Endpoint:
    """Answers as the server's endpoint would, from a script: ``{custom prompt: [(status,
    body), ...]}`` answered in turn (then 200 with the prompt echoed)."""

    def __init__(self, script: dict | None = None):
        self.script = script or {}
        self.asked: list[str] = []

    async def __call__(self, url: str, body: bytes) -> tuple[int, dict]:
        prompt = json.loads(body)["prompt"]
        self.asked.append(prompt)
        await asyncio.sleep(0)
        if self.script.get(prompt):
            return self.script[prompt].pop(0)
        return 200, {"text": prompt.upper(), "usage": {"prompt_tokens": 2, "completion_tokens": 3}}


def lines(*prompts: str) -> bytes:
    return b"".join(
        json.dumps({"custom_id": p, "method": "POST", "url": URL, "body": {"prompt": p}}).encode()
        + b"\n"
        for p in prompts
    )


def start(tmp_path, data: bytes, send: Send, parallel: int = 2, **changes):
    """A batch of ``data`` added to a new runner, and run until the runner has nothing left
    to run (or it stopped)."""
    files = FileStore(tmp_path / "files", print)
    uploaded = files.add("in.jsonl", "batch", io.BytesIO(data))
    runner = BatchRunner(files, send, parallel, print)
    batch = {**new_batch(uploaded["id"], URL, {}, "m"), **changes}

    async def added() -> None:
        runner.add(batch, *check_input(files.path(uploaded["id"]), URL, 2**20))
        await run(runner)

    asyncio.run(added())
    return files, runner, batch


async def run(runner: BatchRunner) -> None:
    runner.start()
    unfinished = ("in_progress", "finalizing", "cancelling")
    while not runner.worker.done() and (
        runner.waiting or any(b["status"] in unfinished for b in runner.batches.values())
    ):
        await asyncio.sleep(0.01)


def written(files: FileStore, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in files.path(file_id).read_bytes().splitlines()]


def test_a_busy_server_is_asked_again_and_every_request_gets_one_record(tmp_path, monkeypatch):
    busy = (429, {"error": {"code": "server_busy", "message": "busy"}})
    refused = (400, {"error": {"code": None, "message": "no"}})
    send = Endpoint({"b": [busy, busy], "c": [refused]})
    files, runner, batch = start(tmp_path, lines("a", "b", "c", "d"), send)
    monkeypatch.setattr(batch_runner, "BUSY_WAIT", 0.01)
    asyncio.run(run(runner))

    assert batch["status"] == "completed"
    assert sorted(send.asked) == ["a", "b", "b", "b", "c", "d"]
    out = written(files, batch["output_file_id"])
    assert sorted(r["custom_id"] for r in out) == ["a", "b", "d"]
    assert {r["custom_id"]: r["response"]["body"]["text"] for r in out}["b"] == "B"
    (error,) = written(files, batch["error_file_id"])
    assert (error["custom_id"], error["response"]["status_code"]) == ("c", 400)
    assert batch["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert (batch["usage"]["input_tokens"], batch["usage"]["output_tokens"]) == (6, 9)
    on_disk = json.loads((files.folder / f"{batch['id']}.json").read_text())
    assert on_disk == batch


def test_a_stop_leaves_the_rest_for_the_next_start_and_a_torn_record_is_asked_again(tmp_path):
    stopping = (503, {"error": {"code": "shutting_down", "message": "stopping"}})
    send = Endpoint({"c": [stopping]})
    files, runner, batch = start(tmp_path, lines("a", "b", "c", "d", "e"), send, parallel=1)
    assert batch["status"] == "in_progress" and runner.stopping
    assert [r["custom_id"] for r in written(files, batch["output_file_id"])] == ["a", "b"]
    # a crash mid-write: the last record cut short
    output = files.path(batch["output_file_id"])
    output.write_bytes(output.read_bytes() + b'{"id": "batch_req_x", "custom_id": "c", "res')
    files.close()

    again = FileStore(tmp_path / "files", print)
    send = Endpoint()
    runner = BatchRunner(again, send, 2, print)
    runner.load()
    assert runner.waiting == [batch["id"]]
    asyncio.run(run(runner))
    batch = runner.batches[batch["id"]]
    assert batch["status"] == "completed"
    assert sorted(send.asked) == ["c", "d", "e"]
    assert [r["custom_id"] for r in written(again, batch["output_file_id"])] == list("abcde")
    assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}


def test_a_batch_past_its_window_expires_with_what_it_holds(tmp_path):
    send = Endpoint()
    files, runner, batch = start(tmp_path, lines("a", "b"), send, expires_at=0)
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert send.asked == [] and batch["output_file_id"] is None


def test_an_input_is_checked_whole_and_its_request_count_bounded(tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl"
    path.write_bytes(lines("a", "b", "c") + b"\n  \n")
    assert check_input(path, URL, 2**20) == (3, [], 0)
    monkeypatch.setattr(batch_runner, "MOST_REQUESTS", 2)
    count, errors, n = check_input(path, URL, 2**20)
    assert (count, n) == (3, 1)
    assert errors[0]["message"] == "the input file holds 3 requests; a batch takes at most 2"
    monkeypatch.undo()
    monkeypatch.setattr(batch_runner, "LISTED_ERRORS", 2)
    path.write_bytes(b"[1]\n" * 5)
    count, errors, n = check_input(path, URL, 2**20)
    assert (count, len(errors), n) == (5, 2, 5)
    assert [e["line"] for e in errors] == [1, 2]
    monkeypatch.undo()
    path.write_bytes(lines("a") + b"[" + b"0," * 1000 + b"0]\n" + lines("b") + b"x" * 3000)
    count, errors, n = check_input(path, URL, 1000)
    assert (count, n) == (4, 2)
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "line_too_large"),
        (4, "line_too_large"),
    ]
    assert errors[0]["message"] == (
        "line 2 is larger than a request this server takes (1,000 bytes, --max-body)"
    )


def test_the_folder_s_other_and_crafted_files_are_left_alone(tmp_path):
    folder = tmp_path / "files"
    files = FileStore(folder, print)
    kept = files.add("a.jsonl", "batch", io.BytesIO(b"abc\n"))
    strangers = {
        "notes.txt": b"the user's",
        "file-0123.json": b"{}",
        f"file-{'1' * 24}.json": json.dumps({"id": "file-other", "object": "file"}).encode(),
        f"file-{'2' * 24}.json": b"[" * 100000,
        f"batch_{'3' * 24}.json": b'{"id": 1}',
    }
    for name, data in strangers.items():
        (folder / name).write_bytes(data)
    (folder / f"file-{'2' * 24}").write_bytes(b"x")
    assert [f["id"] for f in files.all()] == [kept["id"]]
    assert files.get("../notes") is None and files.get(f"file-{'1' * 24}") is None
    runner = BatchRunner(files, Endpoint(), 1, print)
    runner.load()
    assert runner.batches == {}
    files.delete(kept["id"])
    assert files.all() == []
    for name, data in strangers.items():
        assert (folder / name).read_bytes() == data
    with pytest.raises(Exception, match="in use by another mlxkv server"):
        FileStore(folder, print)


def test_expired_files_are_gone_at_once_and_removed_unless_a_running_batch_uses_them(tmp_path):
    folder = tmp_path / "files"
    files = FileStore(folder, print)
    old, used, lasting = (files.add(f"{n}.jsonl", "batch", io.BytesIO(b"x\n"), 3600) for n in "abc")
    kept = files.add("d.jsonl", "batch", io.BytesIO(b"x\n"))  # no lifetime: until deleted
    assert kept["expires_at"] is None
    assert lasting["expires_at"] == lasting["created_at"] + 3600
    for f in (old, used):  # their hour has passed
        path = folder / f"{f['id']}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "expires_at": 1}))
    assert files.get(old["id"]) is None and files.get(used["id"]) is None
    assert [f["id"] for f in files.all()] == [lasting["id"], kept["id"]]

    runner = BatchRunner(files, Endpoint(), 1, print)
    runner.batches["batch_x"] = {**new_batch(used["id"], URL, {}, "m"), "status": "in_progress"}
    asyncio.run(runner.expire())
    assert not files.path(old["id"]).exists()
    assert not (folder / f"{old['id']}.json").exists()
    assert files.path(used["id"]).read_bytes() == b"x\n"  # the running batch reads it
    assert files.get(lasting["id"]) is not None and files.get(kept["id"]) is not None
    runner.batches["batch_x"]["status"] = "completed"
    asyncio.run(runner.expire())
    assert not files.path(used["id"]).exists()


def test_a_batch_s_output_lives_as_long_as_it_asked(tmp_path):
    files, runner, batch = start(tmp_path, lines("a"), Endpoint())
    assert files.get(batch["output_file_id"])["expires_at"] is None
    files.close()
    files, runner, batch = start(
        tmp_path / "two", lines("a"), Endpoint(), output_expires_after={"seconds": 7200}
    )
    output = files.get(batch["output_file_id"])
    assert output["expires_at"] == output["created_at"] + 7200
    files.close()
    crafted = {"seconds": "7200"}  # a batch object written by hand: no lifetime
    files, runner, batch = start(
        tmp_path / "three", lines("a"), Endpoint(), output_expires_after=crafted
    )
    assert files.get(batch["output_file_id"])["expires_at"] is None
