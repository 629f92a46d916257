"""What every endpoint checks before it reads a request: who may ask (the API key, or this
machine only without one), the body (bounded in size and in how long it may pause), and
the model it names."""

from __future__ import annotations

import asyncio
import hmac

from starlette.requests import Request

from mlxkv.server.errors import APIError
from mlxkv.server.local import foreign_source
from mlxkv.server.params import parse_json
from mlxkv.server.served import Served

BODY_WAIT = 30.0  # seconds a request body may pause before it gets 408


class Gate:
    """The checks, by ``served``'s key, body limit and model names."""

    def __init__(self, served: Served):
        self.served = served

    def auth(self, request: Request) -> None:
        """A request with the server's key (without one: a request from this machine)."""
        key_wanted = self.served.api_key
        if key_wanted is None:
            self.local(request)
            return
        # OpenAI's clients send "Authorization: Bearer KEY", Anthropic's "x-api-key: KEY"
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            key = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(key.strip().encode(), key_wanted.encode()):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer KEY' (or "
                "'x-api-key: KEY') with the key the server was started with (--api-key or "
                "MLXKV_API_KEY)",
                code="invalid_api_key",
            )

    def local(self, request: Request) -> None:
        why = foreign_source(request.headers.get("host"), request.headers.get("origin"))
        if why is not None:
            raise APIError(
                403,
                f"this server has no API key, so it answers this machine only ({why}); "
                "start it with --api-key to take requests from elsewhere",
                code="forbidden_origin",
            )

    async def body(self, request: Request) -> bytes:
        """The request's body, refused past ``max_body`` bytes or a pause of BODY_WAIT s."""
        limit = self.served.max_body
        declared = request.headers.get("content-length", "")
        too_big = APIError(
            413,
            f"the request body is larger than this server takes ({limit} bytes, --max-body)",
            code="request_too_large",
        )
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        parts = request.stream().__aiter__()
        while True:
            try:  # a client that stops mid-body would hold its connection for ever
                chunk = await asyncio.wait_for(parts.__anext__(), BODY_WAIT)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise APIError(
                    408,
                    f"the request body stopped arriving (nothing for {BODY_WAIT:g} s); send it "
                    "whole",
                    code="request_timeout",
                ) from None
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def json(self, request: Request, empty: dict | None = None) -> dict:
        """The body as a JSON object (``empty`` stands for a body with nothing in it)."""
        raw = await self.body(request)
        return dict(empty) if empty is not None and not raw.strip() else parse_json(raw)

    def model(self, name: str | None) -> None:
        """A request's ``model``: absent, or one of the names this server answers to."""
        served = self.served
        if name is not None and not served.serves(name):
            raise APIError(
                404,
                f"The model '{name}' does not exist on this server: it serves '{served.id}' "
                "(GET /v1/models); the model is chosen when mlxkv serve starts "
                "(--served-model-name gives it more names)",
                param="model",
                code="model_not_found",
            )
