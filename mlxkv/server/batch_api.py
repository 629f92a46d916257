"""OpenAI's Files and Batch APIs (``/v1/files``, ``/v1/batches``), as the official clients
use them to run a file of requests: the file uploaded, a batch created on it, the batch read
until it ends, its output file downloaded. The files are kept by
:mod:`mlxkv.server.file_store`, the batches run by :mod:`mlxkv.server.batch_runner`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import contextmanager

import httpx
from python_multipart.multipart import parse_options_header
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from mlxkv.server.batch_runner import ENDPOINTS, BatchRunner, Send, check_input, new_batch
from mlxkv.server.errors import APIError, bad
from mlxkv.server.file_store import FILE_LIMIT, LIFETIMES, UPLOAD_LIFETIME, FileStore
from mlxkv.server.gate import Gate
from mlxkv.server.pages import item_page
from mlxkv.server.responses import metadata_of

PURPOSES = ("batch",)  # what an upload may be for: the files this server reads
EXPIRY_FIELDS = ("expires_after[anchor]", "expires_after[seconds]")  # as a form sends them
BATCH_FIELDS = (
    "input_file_id",
    "endpoint",
    "completion_window",
    "metadata",
    "output_expires_after",
)
FILENAME_LIMIT = 255  # characters of an upload's name kept
FORM_SLACK = 64 * 2**10  # bytes of a form around its file (boundaries, headers, purpose)


class BatchAPI:
    """The endpoints, on ``files`` and ``runner`` (None: the server keeps no files),
    behind the server's ``gate``."""

    def __init__(self, files: FileStore | None, runner: BatchRunner | None, model: str, gate: Gate):
        self.files = files
        self.runner = runner
        self.model = model
        self.gate = gate

    # -- files --------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        """``POST /v1/files``: a form of ``file`` and ``purpose``."""
        files = self._files(request)
        form = await _form(request)
        try:
            unknown = sorted(set(form) - {"file", "purpose", *EXPIRY_FIELDS})
            if unknown:
                raise bad(
                    f"Unrecognized request argument supplied: {unknown[0]}",
                    unknown[0],
                    "unknown_parameter",
                )
            lifetime = UPLOAD_LIFETIME
            if any(name in form for name in EXPIRY_FIELDS):
                given = {name[len("expires_after[") : -1]: form.get(name) for name in EXPIRY_FIELDS}
                lifetime = lifetime_of({k: v for k, v in given.items() if v is not None})
            purpose = form.get("purpose")
            if purpose not in PURPOSES:
                raise bad(
                    f"purpose must be 'batch' (the input of a batch), got {str(purpose)[:100]!r}",
                    "purpose",
                )
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise bad("file is required: the file's bytes, as a form's file field", "file")
            name = (upload.filename or "upload")[:FILENAME_LIMIT]
            with _written("the file"):
                described = await asyncio.to_thread(files.add, name, purpose, upload.file, lifetime)
        finally:
            await form.close()
        return JSONResponse(described)

    async def listing(self, request: Request) -> Response:
        """``GET /v1/files`` (``purpose``, ``limit``, ``order``, ``after``)."""
        files = self._files(request)
        found = await asyncio.to_thread(files.all)
        purpose = request.query_params.get("purpose")
        if purpose is not None:
            found = [f for f in found if f["purpose"] == purpose]
        page = item_page(found, request.query_params, "the files", 10_000, 10_000)
        return JSONResponse(page)

    async def one_file(self, request: Request) -> Response:
        """``GET`` and ``DELETE /v1/files/{id}``."""
        files = self._files(request)
        described = self._file(files, request.path_params["id"])
        if request.method == "DELETE":
            user = self.runner.reader_of(described["id"])
            if user is not None:
                raise bad(
                    f"the file is in use by {user['id']} ({user['status']}): cancel the batch "
                    "or let it end first",
                    code="file_in_use",
                )
            with _written("the file's removal"):
                await asyncio.to_thread(files.delete, described["id"])
            return JSONResponse({"id": described["id"], "object": "file", "deleted": True})
        return JSONResponse(described)

    async def content(self, request: Request) -> Response:
        """``GET /v1/files/{id}/content``: the file's bytes."""
        files = self._files(request)
        described = self._file(files, request.path_params["id"])
        return FileResponse(files.path(described["id"]), media_type="application/octet-stream")

    # -- batches ------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        """``POST /v1/batches``: ``input_file_id``, ``endpoint``, ``completion_window``,
        ``metadata``; the input is checked before the answer (a batch whose lines cannot
        run is answered ``failed``, with its errors)."""
        files = self._files(request)
        body = await self.gate.json(request)
        for name in body:
            if name not in BATCH_FIELDS:
                raise bad(
                    f"Unrecognized request argument supplied: {name}", name, "unknown_parameter"
                )
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise bad(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if body.get("completion_window") != "24h":
            raise bad("completion_window must be '24h'", "completion_window")
        metadata = metadata_of(body.get("metadata"))
        expiry = body.get("output_expires_after")
        lifetime = None if expiry is None else lifetime_of(expiry, "output_expires_after")
        file_id = body.get("input_file_id")
        described = files.get(file_id) if isinstance(file_id, str) else None
        if described is None:
            raise bad(
                f"input_file_id names no file on this server: {str(file_id)[:100]!r} (upload "
                "it with POST /v1/files, purpose 'batch')",
                "input_file_id",
            )
        if described["purpose"] != "batch":
            raise bad(
                f"the input file's purpose is {described['purpose']!r}; a batch reads files "
                "uploaded with purpose 'batch'",
                "input_file_id",
            )
        batch = new_batch(file_id, endpoint, metadata, self.model, lifetime)
        checked = await asyncio.to_thread(
            check_input, files.path(file_id), endpoint, self.runner.max_line
        )
        with _written("the batch"):
            self.runner.add(batch, *checked)
        return JSONResponse(batch)

    async def batches(self, request: Request) -> Response:
        """``GET /v1/batches`` (``limit``, ``after``; the newest first)."""
        self._files(request)
        listed = list(self.runner.batches.values())
        return JSONResponse(item_page(listed, request.query_params, "the batches"))

    async def one_batch(self, request: Request) -> Response:
        """``GET /v1/batches/{id}``."""
        self._files(request)
        return JSONResponse(self._batch(request.path_params["id"]))

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/batches/{id}/cancel``: no request is sent from now on and those in
        flight are stopped; the batch ends ``cancelled``, its files holding what had
        ended."""
        self._files(request)
        batch = self._batch(request.path_params["id"])
        if batch["status"] not in ("validating", "in_progress", "cancelling"):
            raise bad(
                f"the batch has ended ({batch['status']}); only a running one is cancelled",
                code="batch_ended",
            )
        with _written("the batch"):
            self.runner.cancel(batch)
        return JSONResponse(batch)

    # -- shared -------------------------------------------------------------------------
    def _files(self, request: Request) -> FileStore:
        self.gate.auth(request)
        if self.files is None:
            raise APIError(
                404,
                "this server keeps no files, so it runs no batches: start it with a "
                "--files-dir it can own (not 'none')",
                code="files_off",
            )
        return self.files

    def _file(self, files: FileStore, file_id: str) -> dict:
        described = files.get(file_id)
        if described is None:
            raise APIError(404, f"No such File object: {file_id[:100]}", "id", "not_found")
        return described

    def _batch(self, batch_id: str) -> dict:
        batch = self.runner.batches.get(batch_id)
        if batch is None:
            raise APIError(404, f"No batch found with id '{batch_id[:100]}'", "id", "not_found")
        return batch


def lifetime_of(expiry, param: str = "expires_after") -> int:
    """The seconds a file lives from an ``expires_after`` object (``{"anchor": "created_at",
    "seconds": N}``; a form's fields are text)."""
    if not isinstance(expiry, dict):
        raise bad(f"{param} must be an object: {{anchor: 'created_at', seconds: N}}", param)
    for name in expiry:
        if name not in ("anchor", "seconds"):
            raise bad(f"{name[:100]} is not a field of {param}; send anchor and seconds", param)
    if expiry.get("anchor") != "created_at":
        raise bad(f"{param}.anchor must be 'created_at'", f"{param}.anchor")
    seconds = expiry.get("seconds")
    if isinstance(seconds, str) and seconds.isascii() and seconds.isdigit() and len(seconds) < 12:
        seconds = int(seconds)  # (a form's text; a longer one is out of range anyway)
    low, high = LIFETIMES
    if type(seconds) is not int or not low <= seconds <= high:
        raise bad(
            f"{param}.seconds must be a whole number of seconds from {low} (1 hour) to {high} "
            f"(30 days), got {str(seconds)[:40]}",
            f"{param}.seconds",
        )
    return seconds


async def _form(request: Request):
    """The request's multipart form, its bytes bounded (a larger upload is a 413 before
    it is all read)."""
    kind, _ = parse_options_header(request.headers.get("content-type", ""))
    if kind != b"multipart/form-data":
        raise bad(
            "send the file as multipart/form-data, with the fields 'file' and 'purpose'",
            "file",
        )
    limit = FILE_LIMIT + FORM_SLACK
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_big()

    async def bounded() -> AsyncIterator[bytes]:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_big()
            yield chunk

    parser = MultiPartParser(request.headers, bounded(), max_files=1, max_fields=8)
    try:
        return await parser.parse()
    except MultiPartException as e:
        raise bad(f"the form cannot be read: {e.message}", "file") from None


def _too_big() -> APIError:
    return APIError(
        413,
        f"the file is larger than this server takes ({FILE_LIMIT:,} bytes, OpenAI's limit for "
        "a batch's input): split it into smaller batches",
        "file",
        "file_too_large",
    )


@contextmanager
def _written(what: str):
    """A change the folder could not take is a 500 naming why, not a traceback."""
    try:
        yield
    except OSError as e:
        raise APIError(
            500, f"{what} could not be written: {e.strerror or e}", code="file_write_failed"
        ) from None


def loopback(app, api_key: str | None) -> Send:
    """A batch's request sent to an endpoint of ``app`` (the server's ASGI app) in this
    process, no socket, with the server's key: the answer a client would get."""
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=None
    )
    headers = {"content-type": "application/json"}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"

    async def send(url: str, request: bytes) -> tuple[int, dict]:
        answer = await client.post(url, content=request, headers=headers)
        try:
            body = answer.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):  # every endpoint answers an object; keep what came
            body = {"error": {"message": answer.text[:1000]}}
        return answer.status_code, body

    return send
