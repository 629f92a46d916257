"""What a server says about itself: the served model as OpenAI's, Anthropic's, Ollama's and
llama.cpp's clients list and show it, its health, and the scheduler's state (``/v1/status``
and Prometheus' ``/metrics``)."""

from __future__ import annotations

from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mlxkv import __version__
from mlxkv.server import llamacpp, metrics, ollama
from mlxkv.server.bridge import Bridge
from mlxkv.server.errors import bad
from mlxkv.server.gate import Gate
from mlxkv.server.params import parse_json
from mlxkv.server.served import Served
from mlxkv.server.tools import has_tool_calling


class ModelInfo:
    """The endpoints, on ``served`` and ``bridge``; ``runner``: the batch runner (None
    without files); ``fills_in``: the model has fill-in-the-middle tokens."""

    def __init__(self, served: Served, bridge: Bridge, gate: Gate, runner, fills_in: bool):
        self.served, self.bridge, self.gate = served, bridge, gate
        self.runner = runner
        self.fills_in = fills_in
        self.scrape = metrics.registry(self.status_now)

    # -- OpenAI's and Anthropic's --------------------------------------------------------
    def model_card(self) -> dict:
        """The served model as both APIs list one (OpenAI's fields, then Anthropic's), and
        its context as vLLM lists it (``max_model_len``) and OpenRouter (``context_length``,
        which llama.vscode and other clients look for), which clients read to size their
        prompts."""
        served = self.served
        started = datetime.fromtimestamp(served.started, timezone.utc)
        context = served.limits.context_length
        return {
            "id": served.id,
            "object": "model",
            "created": served.started,
            "owned_by": "mlxkv",
            "type": "model",
            "display_name": served.id,
            "created_at": started.isoformat().replace("+00:00", "Z"),
            "lifecycle": "active",
            **({"max_model_len": context, "context_length": context} if context else {}),
        }

    async def models(self, request: Request) -> Response:
        self.gate.auth(request)
        name = self.served.id
        listed = {"object": "list", "data": [self.model_card()]}
        return JSONResponse({**listed, "has_more": False, "first_id": name, "last_id": name})

    async def one_model(self, request: Request) -> Response:
        self.gate.auth(request)
        self.gate.model(request.path_params["name"])
        return JSONResponse(self.model_card())

    # -- Ollama's ---------------------------------------------------------------------------
    def _modified(self) -> str:
        return datetime.fromtimestamp(self.served.started, timezone.utc).isoformat()

    def _listing(self) -> dict:
        return ollama.listing(self.served.id, self.served.facts, self._modified())

    async def api_tags(self, request: Request) -> Response:
        self.gate.auth(request)
        return JSONResponse({"models": [self._listing()]})

    async def api_ps(self, request: Request) -> Response:
        self.gate.auth(request)
        facts = self.served.facts
        loaded = self._listing()
        loaded.update(
            expires_at=None,  # loaded while the server runs
            size_vram=facts.get("size", 0),  # unified memory: all of it
            context_length=facts.get("context_length"),
        )
        return JSONResponse({"models": [loaded]})

    async def api_show(self, request: Request) -> Response:
        self.gate.auth(request)
        served = self.served
        body = parse_json(await self.gate.body(request))
        for k in body:
            if k not in ("model", "name", "verbose"):
                raise bad(f"{k} is not a field of this request; send model", k)
        name = body.get("model") or body.get("name")
        if not isinstance(name, str):
            raise bad("model is required", "model")
        self.gate.model(ollama.served_name(name, served.serves) or name)
        tok = served.tokenizer
        abilities = ["completion"]
        abilities += ["tools"] if has_tool_calling(tok) else []
        abilities += ["thinking"] if getattr(tok, "has_thinking", False) else []
        abilities += ["insert"] if self.fills_in else []  # fill-in-the-middle
        abilities += ["embedding"] if served.facts.get("embedding_model") else []
        template = getattr(tok, "chat_template", None)
        return JSONResponse(
            {
                "license": "",
                "modelfile": "",
                "parameters": "",
                "template": template if isinstance(template, str) else "",
                "details": ollama.details(served.facts),
                "model_info": ollama.model_info(served.facts, served.id),
                "capabilities": abilities,
                "modified_at": self._modified(),
            }
        )

    async def api_version(self, request: Request) -> Response:
        return JSONResponse({"version": ollama.API_VERSION})

    async def root(self, request: Request) -> Response:
        """What Ollama's clients probe before they talk to a server (``GET``/``HEAD /``)."""
        return PlainTextResponse("mlxkv is running")

    # -- llama.cpp's ----------------------------------------------------------------------
    async def props(self, request: Request) -> Response:
        self.gate.auth(request)
        served = self.served
        return JSONResponse(
            llamacpp.props_body(
                served.id, served.limits, served.tokenizer, served.max_batch, f"mlxkv {__version__}"
            )
        )

    # -- the server's own -----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.bridge.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.served.id})

    def status_now(self) -> dict:
        served, bridge = self.served, self.bridge
        now = bridge.scheduler.status()
        now["refused"] = {**now.get("refused", {}), "busy": bridge.refused_busy}
        return {
            "model": served.id,
            "policy": served.policy.describe(),
            "max_batch": served.max_batch,
            "ranks": served.ranks,
            "rows_in_flight": bridge.rows_in_flight,
            "draining": bridge.draining,
            **now,
            "response_store": served.stored.usage(),
            "conversation_store": served.conversations.usage(),
            "batches": None if self.runner is None else self.runner.usage(),
        }

    async def status(self, request: Request) -> Response:
        self.gate.auth(request)
        return JSONResponse(self.status_now())

    async def metrics(self, request: Request) -> Response:
        self.gate.auth(request)
        body, content_type = metrics.exposition(self.scrape)
        return Response(body, media_type=content_type)
