"""OpenAI's Batch API run on this server: a batch's input file checked line by line, its
requests answered through the server's own endpoints (each gets the answer a client sending
it would get, from the same scheduler as every other request), and each answer's record
appended to the batch's output file (a 2xx answer) or error file, fsynced.

The batch objects are kept beside the files (``batch_<24 hex>.json``, replaced whole at each
change of state), so a restarted server lists them, and a batch the server stopped in goes
on from the records its files hold: a request whose record was written is not asked again.
Batches run one after another; a batch keeps as many requests in flight as the server
batches answers (``--max-batch``), each one taking its turn in the scheduler's queue with
the clients' requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mlxkv.errors import UserError, first_line
from mlxkv.files import parse_json, read_bytes
from mlxkv.server.file_store import FileStore

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MOST_REQUESTS = 50_000  # per batch, as OpenAI takes them
LISTED_ERRORS = 100  # a failed batch's errors listed (the count is given in full)
WINDOW = 24 * 3600  # completion_window "24h": a batch still running then expires
SWEEP_EVERY = 600  # seconds between looks for expired files while no batch runs
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
BATCH_FILE_LIMIT = 256 * 2**10  # bytes of a batch object read back
LINE_FIELDS = {"custom_id", "method", "url", "body"}
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
BUSY_WAIT = 1.0  # seconds before a request the server was too busy for is sent again


class Send(Protocol):
    """A request answered by the server's own endpoint: ``(status, JSON body)``."""

    async def __call__(self, url: str, body: bytes) -> tuple[int, dict]: ...


@dataclass
class Line:
    number: int
    custom_id: str
    body: dict


class BadLine(Exception):
    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class Stopped(Exception):
    """The server is shutting down: the batch goes on at its next start."""


def read_line(number: int, raw: bytes, endpoint: str) -> Line:
    """One request line of an input file, or :class:`BadLine` saying what is wrong."""
    try:
        obj = parse_json(raw.decode(), f"line {number}")
    except (UnicodeDecodeError, UserError):
        obj = None
    if not isinstance(obj, dict):
        raise BadLine("invalid_json_line", f"line {number} is not a JSON object")
    if extra := sorted(set(obj) - LINE_FIELDS):
        raise BadLine(
            "unknown_parameter",
            f"line {number}: unknown field {extra[0]!r}; a line holds custom_id, method, url "
            "and body",
            extra[0],
        )
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(
            "missing_required_parameter",
            f"line {number}: custom_id must be a string naming the request",
            "custom_id",
        )
    if obj.get("method") != "POST":
        raise BadLine("invalid_method", f'line {number}: method must be "POST"', "method")
    if obj.get("url") != endpoint:
        raise BadLine(
            "mismatched_endpoint",
            f"line {number}: url {str(obj.get('url'))[:100]!r} is not the batch's endpoint "
            f"{endpoint}",
            "url",
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadLine("invalid_body", f"line {number}: body must be the request's object", "body")
    if body.get("stream") or body.get("background"):
        field = "stream" if body.get("stream") else "background"
        raise BadLine(
            "invalid_body",
            f"line {number}: body.{field} is not taken in a batch (its answer is its record)",
            "body",
        )
    return Line(number, custom_id, body)


def lines_of(path: Path, most: int) -> Iterator[tuple[int, bytes | None]]:
    """The file's lines that are not blank, numbered from 1; None for one longer than
    ``most`` bytes (never read whole: a request that long would be refused anyway)."""
    with open(path, "rb") as f:
        number = 0
        while raw := f.readline(most + 1):
            number += 1
            if len(raw) > most and not raw.endswith(b"\n"):
                while (rest := f.readline(2**20)) and not rest.endswith(b"\n"):
                    pass
                yield number, None
            elif raw.strip():
                yield number, raw


def check_input(path: Path, endpoint: str, most: int) -> tuple[int, list[dict], int]:
    """An input file's requests (lines of at most ``most`` bytes) counted, and what keeps
    it from running: OpenAI's error objects (the first ``LISTED_ERRORS``) and how many
    there are."""
    errors, count, seen = [], 0, set()

    def error(code: str, message: str, line: int | None = None, param=None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": line})

    try:
        for number, raw in lines_of(path, most):
            count += 1
            if raw is None:
                error(
                    "line_too_large",
                    f"line {number} is larger than a request this server takes ({most:,} "
                    "bytes, --max-body)",
                    number,
                )
                continue
            try:
                line = read_line(number, raw, endpoint)
            except BadLine as e:
                error(e.code, e.message, number, e.param)
                continue
            if line.custom_id in seen:
                error(
                    "duplicate_custom_id",
                    f"line {number}: custom_id {line.custom_id[:100]!r} is on an earlier line; "
                    "each request needs its own",
                    number,
                    "custom_id",
                )
            seen.add(line.custom_id)
    except OSError as e:
        error("file_unreadable", f"the input file cannot be read: {e.strerror or e}")
    if not count and not errors:
        error("empty_file", "the input file holds no request lines")
    if count > MOST_REQUESTS:
        error(
            "too_many_requests",
            f"the input file holds {count:,} requests; a batch takes at most {MOST_REQUESTS:,}",
        )
    return count, errors[:LISTED_ERRORS], len(errors)


def new_batch(
    input_file_id: str, endpoint: str, metadata: dict, model: str, lifetime: int | None = None
) -> dict:
    """A batch object, as OpenAI's API answers it; ``lifetime``: the seconds its output and
    error files live (None: until deleted), kept as ``output_expires_after``."""
    now = int(time.time())
    return {
        "id": f"batch_{secrets.token_hex(12)}",
        "object": "batch",
        "endpoint": endpoint,
        "model": model,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": "24h",
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + WINDOW,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
        "usage": _usage(),
        "output_expires_after": None
        if lifetime is None
        else {"anchor": "created_at", "seconds": lifetime},
    }


class BatchRunner:
    """The server's batches, by id (oldest first), and the task that runs them."""

    def __init__(
        self,
        files: FileStore,
        send: Send | None,
        parallel: int,
        log: Callable[[str], None],
        max_line: int = 8 * 2**20,
    ):
        self.files = files
        self.max_line = max_line  # bytes of a request line (the server's --max-body)
        self.send = send  # (set once the app it sends to is built)
        self.parallel = max(1, parallel)
        self.log = log
        self.batches: dict[str, dict] = {}
        self.waiting: list[str] = []  # batches not started yet, in order
        self.lines: dict[str, set[asyncio.Task]] = {}  # each running batch's requests in flight
        self.running: str | None = None  # the batch whose requests are being sent
        self.wake: asyncio.Event | None = None
        self.worker: asyncio.Task | None = None
        self.stopping = False

    # -- the folder ---------------------------------------------------------------------
    def load(self) -> None:
        """The batches the folder holds; those a server stopped in wait to go on."""
        found = []
        for path in self.files.folder.iterdir():
            if path.suffix != ".json" or not BATCH_ID.fullmatch(path.stem):
                continue
            try:
                batch = parse_json(read_bytes(path, BATCH_FILE_LIMIT).decode(), "batch")
            except (UserError, UnicodeDecodeError) as e:
                self.log(f"batches: skipped {path.name}: {first_line(e)}")
                continue
            if not _is_batch(batch, path.stem):
                self.log(f"batches: skipped {path.name}: it does not hold a batch")
                continue
            found.append(batch)
        for batch in sorted(found, key=lambda b: (b["created_at"], b["id"])):
            self.batches[batch["id"]] = batch
            if batch["status"] == "cancelling":
                self._end(batch, "cancelled")
            elif batch["status"] in UNFINISHED:
                self.waiting.append(batch["id"])
                self.log(f"batches: {batch['id']} goes on from the records its files hold")

    def save(self, batch: dict) -> None:
        self.files.write_json(f"{batch['id']}.json", batch)

    def reader_of(self, file_id: str) -> dict | None:
        """The unfinished batch that reads or writes ``file_id``, if any."""
        return next((b for b in self._unfinished() if file_id in _files_of(b)), None)

    # -- what the endpoints ask ---------------------------------------------------------
    def add(self, batch: dict, count: int, errors: list[dict], error_count: int) -> None:
        """A new batch whose input was checked: it fails at once when ``errors``, else it
        waits its turn."""
        now = int(time.time())
        if errors:
            batch.update(status="failed", failed_at=now)
            batch["errors"] = {"object": "list", "data": errors}
            if error_count > len(errors):
                self.log(f"{batch['id']}: {error_count} errors in its input, the first listed")
        else:
            batch.update(status="in_progress", in_progress_at=now)
            batch["request_counts"]["total"] = count
        self.save(batch)
        self.batches[batch["id"]] = batch
        if not errors:
            self.waiting.append(batch["id"])
            self.start()

    def cancel(self, batch: dict) -> None:
        if batch["status"] not in ("validating", "in_progress"):
            return
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        self.save(batch)
        if batch["id"] in self.waiting:  # it had not started
            self.waiting.remove(batch["id"])
            self._end(batch, "cancelled")
        for task in self.lines.get(batch["id"], ()):
            task.cancel()

    def usage(self) -> dict:
        """What ``/v1/status`` shows of the batches."""
        running = self.batches.get(self.running) if self.running else None
        return {
            "running": None
            if running is None
            else {"id": running["id"], **running["request_counts"]},
            "waiting": len(self.waiting),
            "requests_in_flight": sum(map(len, self.lines.values())),
            "batches": len(self.batches),
        }

    def busy(self) -> bool:
        """Whether a batch's requests are in flight (or their records being written)."""
        return any(self.lines.values())

    def start(self) -> None:
        """The task that runs the batches, started in the server's event loop."""
        if self.worker is None:
            self.wake = asyncio.Event()
            self.worker = asyncio.get_running_loop().create_task(self._work())
        self.wake.set()

    # -- running ------------------------------------------------------------------------
    def in_use(self) -> set[str]:
        """The files an unfinished batch reads or writes."""
        return {f for b in self._unfinished() for f in _files_of(b) if f is not None}

    def _unfinished(self):
        return (b for b in self.batches.values() if b["status"] in UNFINISHED)

    async def expire(self) -> None:
        """The files past their ``expires_at`` removed, but those a batch still uses."""
        try:
            gone = await asyncio.to_thread(self.files.expire, self.in_use())
        except OSError as e:
            self.log(f"files: expired files could not be removed: {e.strerror or e}")
            return
        for file_id in gone:
            self.log(f"files: {file_id} expired and was removed")

    async def _work(self) -> None:
        while not self.stopping:
            await self.expire()
            if not self.waiting:
                self.wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):  # a sweep now and then
                    await asyncio.wait_for(self.wake.wait(), SWEEP_EVERY)
                continue
            batch = self.batches[self.waiting.pop(0)]
            self.running = batch["id"]
            try:
                await self._run(batch)
            except Stopped:
                return
            except Exception as e:  # a batch that cannot go on fails, the others run
                self._fail(batch, "batch_failed", f"the batch stopped: {first_line(e)}")
            finally:
                self.running = None

    async def _run(self, batch: dict) -> None:
        done = self._recorded(batch)
        path = self.files.path(batch["input_file_id"])
        if not path.exists():
            self._fail(batch, "input_file_missing", "its input file was deleted")
            return
        turns = asyncio.Semaphore(self.parallel)
        flying = self.lines.setdefault(batch["id"], set())
        writing = asyncio.Lock()
        try:
            for number, raw in lines_of(path, self.max_line):
                line = read_line(number, raw or b"", batch["endpoint"])
                if line.custom_id in done:
                    continue
                await turns.acquire()
                if self._stop_reason(batch):
                    turns.release()
                    break
                task = asyncio.create_task(self._answer(batch, line, writing))
                task.add_done_callback(lambda t: (turns.release(), flying.discard(t)))
                flying.add(task)
            while flying:
                await asyncio.wait(set(flying))
        finally:
            self.lines.pop(batch["id"], None)
        reason = self._stop_reason(batch)
        if reason == "stopping":
            raise Stopped
        if batch["status"] == "failed":
            return
        if reason is None:
            batch.update(status="finalizing", finalizing_at=int(time.time()))
        self._end(batch, reason or "completed")

    def _stop_reason(self, batch: dict) -> str | None:
        if self.stopping:
            return "stopping"
        if batch["status"] == "cancelling":
            return "cancelled"
        if batch["status"] == "failed":
            return "failed"
        if time.time() >= batch["expires_at"]:
            return "expired"
        return None

    async def _answer(self, batch: dict, line: Line, writing: asyncio.Lock) -> None:
        body = json.dumps(line.body).encode()
        while True:
            status, answer = await self.send(batch["endpoint"], body)
            code = (answer.get("error") or {}).get("code") if isinstance(answer, dict) else None
            if status == 429 and code == "server_busy" and not self._stop_reason(batch):
                await asyncio.sleep(BUSY_WAIT)
                continue
            break
        if status == 503 or self.stopping:  # (the server answers 503 only when it stops)
            self.stopping = True  # the line is asked again when the server starts next
            return
        record = {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": line.custom_id,
            "response": {
                "status_code": status,
                "request_id": f"req_{secrets.token_hex(12)}",
                "body": answer,
            },
            "error": None,
        }
        ok = 200 <= status < 300
        async with writing:
            try:
                await asyncio.to_thread(self._append, batch, ok, record)
            except OSError as e:
                self._fail(batch, "output_write_failed", f"a record could not be written: {e}")

    def _append(self, batch: dict, ok: bool, record: dict) -> None:
        """The record written, then counted (here, in the writing thread: a cancel that
        stops the waiting task does not stop the write, and what is written counts)."""
        key = "output_file_id" if ok else "error_file_id"
        if batch[key] is None:
            kind = "output" if ok else "error"
            lifetime = _lifetime(batch.get("output_expires_after"))
            name = f"{batch['id']}_{kind}.jsonl"
            batch[key] = self.files.start(name, "batch_output", lifetime)["id"]
            self.save(batch)
        self.files.append(batch[key], _jsonl(record))
        batch["request_counts"]["completed" if ok else "failed"] += 1
        if ok:
            _add_usage(batch["usage"], record["response"]["body"].get("usage"))

    def _recorded(self, batch: dict) -> set[str]:
        """The custom_ids the batch's files hold records of (its counts and usage made
        again from them); a last line a stop cut short is dropped from its file."""
        done: set[str] = set()
        counts = batch["request_counts"]
        counts["completed"] = counts["failed"] = 0
        batch["usage"] = _usage()
        for key, kind in (("output_file_id", "completed"), ("error_file_id", "failed")):
            file_id = batch[key]
            if file_id is None:
                continue
            path = self.files.path(file_id)
            if not path.exists():
                self.log(f"{batch['id']}: its {key[:-3]} {file_id} was deleted; a new one is made")
                batch[key] = None
                continue
            whole = 0  # bytes of whole lines (a file of many answers is read a line at a time)
            with open(path, "rb") as f:
                for raw in f:
                    if not raw.endswith(b"\n"):  # the last line, cut short by a stop
                        break
                    whole += len(raw)
                    try:
                        record = json.loads(raw)
                        done.add(record["custom_id"])
                    except (ValueError, KeyError, TypeError):  # not a record: it runs again
                        continue
                    counts[kind] += 1
                    if kind == "completed":
                        with contextlib.suppress(KeyError, TypeError, AttributeError):
                            body = record["response"]["body"]
                            _add_usage(batch["usage"], body.get("usage"))
            if whole < path.stat().st_size:
                os.truncate(path, whole)  # (the server's own file: its torn record goes)
        return done

    def _fail(self, batch: dict, code: str, message: str) -> None:
        print(f"mlxkv: {batch['id']} failed: {message}", file=sys.stderr, flush=True)
        batch["errors"] = {
            "object": "list",
            "data": [{"code": code, "message": message, "param": None, "line": None}],
        }
        self._end(batch, "failed")

    def _end(self, batch: dict, status: str) -> None:
        batch.update({"status": status, f"{status}_at": int(time.time())})
        for task in self.lines.get(batch["id"], ()):
            task.cancel()
        with contextlib.suppress(OSError):  # the object in memory is right; say so once
            self.save(batch)
            return
        self.log(f"{batch['id']}: its object could not be written to {self.files.folder}")


def _jsonl(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _usage() -> dict:
    return {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }


def _add_usage(total: dict, usage) -> None:
    """An answer's usage (chat's, completions', embeddings' or responses' fields) added."""
    if not isinstance(usage, dict):
        return

    def number(*names: str, within: dict = usage) -> int:
        for name in names:
            v = within.get(name) if isinstance(within, dict) else None
            if isinstance(v, int):
                return v
        return 0

    given = number("input_tokens", "prompt_tokens")
    made = number("output_tokens", "completion_tokens")
    details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details")
    thought = usage.get("output_tokens_details") or usage.get("completion_tokens_details")
    total["input_tokens"] += given
    total["output_tokens"] += made
    total["total_tokens"] += given + made
    total["input_tokens_details"]["cached_tokens"] += number("cached_tokens", within=details)
    total["output_tokens_details"]["reasoning_tokens"] += number("reasoning_tokens", within=thought)


def _files_of(batch: dict) -> tuple:
    """The ids of the files a batch reads and writes (None where it has none yet)."""
    return batch["input_file_id"], batch["output_file_id"], batch["error_file_id"]


def _lifetime(expiry) -> int | None:
    """The seconds of a batch's ``output_expires_after`` (None: none, or not one)."""
    seconds = expiry.get("seconds") if isinstance(expiry, dict) else None
    return seconds if type(seconds) is int and seconds > 0 else None


def _is_batch(v, batch_id: str) -> bool:
    return (
        isinstance(v, dict)
        and v.get("id") == batch_id
        and v.get("object") == "batch"
        and v.get("endpoint") in ENDPOINTS
        and isinstance(v.get("input_file_id"), str)
        and isinstance(v.get("status"), str)
        and type(v.get("created_at")) is int
        and type(v.get("expires_at")) is int
        and isinstance(v.get("request_counts"), dict)
        and all(type(v["request_counts"].get(k)) is int for k in ("total", "completed", "failed"))
        and all(
            v.get(k) is None or isinstance(v.get(k), str)
            for k in ("output_file_id", "error_file_id")
        )
    )
