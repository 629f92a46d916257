"""The HTTP API (Starlette): its routes, and the endpoints that answer with the model
(OpenAI's chat and text completions, responses and embeddings, Anthropic's messages,
Ollama's chat, generate and embed, llama.cpp's completion and infill), streamed or whole.
The others live beside it: the model's listings and the server's state (``model_info``),
token counts (``token_api``), conversations, files and batches."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import replace

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxkv.engine.events import (
    Embedding,
    Failed,
    Finished,
    Notice,
    PromptLogprobs,
    Stats,
    TokenDelta,
)
from mlxkv.engine.request import GenerationSettings
from mlxkv.errors import first_line
from mlxkv.policy import KVPolicy
from mlxkv.server import embeddings, llamacpp, ollama
from mlxkv.server.answers import (
    Choice,
    Envelope,
    Part,
    TokenText,
    chat_logprob,
    prompt_entries,
)
from mlxkv.server.answers import usage as usage_of
from mlxkv.server.batch_api import BatchAPI, loopback
from mlxkv.server.batch_runner import BatchRunner
from mlxkv.server.bridge import Bridge, Run
from mlxkv.server.conversations import Conversations
from mlxkv.server.errors import APIError
from mlxkv.server.gate import Gate
from mlxkv.server.local import is_local_origin
from mlxkv.server.messages import Message, error_response, event, parse_messages
from mlxkv.server.model_info import ModelInfo
from mlxkv.server.params import (
    Ask,
    api_names,
    parse_chat,
    parse_completion,
    parse_json,
)
from mlxkv.server.prompts import TEXT_KINDS, Prompts
from mlxkv.server.reasoning import think_reader
from mlxkv.server.response_api import ResponseAPI
from mlxkv.server.responses import (
    Reply,
    Turn,
)
from mlxkv.server.served import Served
from mlxkv.server.stream import EventStream
from mlxkv.server.token_api import TokenAPI
from mlxkv.server.tools import held_calls, reader_for

ENDPOINTS = (
    "/v1/chat/completions, /v1/completions, /v1/responses, /v1/conversations, /v1/messages, "
    "/v1/messages/count_tokens, /v1/embeddings, /v1/files, /v1/batches, /v1/models, "
    "/v1/status, /metrics, /health, /tokenize, /detokenize, llama.cpp's /completion, "
    "/infill, /props and /apply-template, "
    "and Ollama's /api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags, "
    "/api/show, /api/ps, /api/version"
)
PARSERS = {
    "chat": parse_chat,
    "completion": parse_completion,
    "messages": parse_messages,
    "api_chat": ollama.parse_chat,
    "api_generate": ollama.parse_generate,
}
FORMAT_PARAMS = {  # where each API asks for an answer's schema
    "chat": "response_format",
    "responses": "text.format",
    "messages": "output_config.format",
    "api_chat": "format",
    "api_generate": "format",
}
BLOCKS = ("messages", "responses")  # one answer, as a list of blocks or items
OLLAMA = ("api_chat", "api_generate")
LLAMA = ("infill", "llama_completion")  # llama.cpp's own endpoints
# the field that holds each kind's prompt (an error about the prompt names it)
PROMPT_PARAMS = {
    "completion": "prompt",
    "llama_completion": "prompt",
    "infill": "input_prefix",
    "responses": "input",
    "embeddings": "input",
}
LOGGED_MESSAGE = 1000  # characters of an error message the log line keeps


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class Disconnect:
    """Watches the connection while an answer is prepared (before any byte is sent)."""

    def __init__(self, request: Request):
        self.task = asyncio.ensure_future(self._watch(request.receive))

    @staticmethod
    async def _watch(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def next(self, run: Run):
        get = asyncio.ensure_future(run.next())
        done, _ = await asyncio.wait({get, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        raise ClientGone

    def stop(self) -> None:
        self.task.cancel()


def build_app(served: Served, bridge: Bridge) -> Starlette:
    words = TokenText(served.tokenizer)
    gate = Gate(served)
    prompts_of = Prompts(served, bridge.scheduler.encode)
    talks = Conversations(served.conversations, gate)
    runner = None
    if served.files is not None:
        runner = BatchRunner(served.files, None, served.batch_requests, _say, served.max_body)
        runner.load()
    batch_api = BatchAPI(served.files, runner, served.id, gate)
    info = ModelInfo(served, bridge, gate, runner, prompts_of.fim is not None)
    tokens = TokenAPI(served, gate, prompts_of)
    kept = ResponseAPI(served, gate, prompts_of, talks)

    async def completions(request: Request, kind: str) -> Response:
        gate.auth(request)
        body = parse_json(await gate.body(request))
        if kind == "responses":
            ask, turn = kept.parse(body)
        elif kind in LLAMA:
            ask, fill = llamacpp.parse_infill(body, served.limits, kind == "infill")
        else:
            ask = PARSERS[kind](body, served.limits)
        if kind in OLLAMA:  # Ollama's clients add its default tag to a name
            ask = replace(ask, model=ollama.served_name(ask.model, served.serves) or ask.model)
        gate.model(ask.model)
        prompts_of.check_tool_format(ask)
        if (held := held_calls(ask.tools, served.tokenizer)) is not None:
            ask = replace(ask, settings=replace(ask.settings, call_grammar=held))
        rendered = None
        if kind == "responses":
            ask = kept.with_conversation(ask, turn)
            if turn.truncate:
                ask, rendered = await run_in_threadpool(prompts_of.truncated, ask)
        if ask.suffix is not None:
            ask = prompts_of.fill_in(ask)
        if kind == "infill":
            ask = await run_in_threadpool(prompts_of.infill, ask, fill)
        if kind in OLLAMA and not (ask.messages or ask.prompts):
            # nothing to answer: a client making sure the model is loaded (it always is)
            return JSONResponse(ollama.Reply(served.id, kind == "api_chat").loaded())
        prompts, text = rendered or await run_in_threadpool(prompts_of.render, ask)
        predicted = None
        if ask.prediction:
            predicted = await run_in_threadpool(prompts_of.prediction_ids, ask.prediction)
        run = bridge.start(
            prompts,
            ask.n,
            ask.settings,
            ask.policy,
            ask.logprobs,
            ask.prompt_logprobs,
            prediction=predicted,
        )
        if kind == "responses" and turn.background:
            return in_background(run, Reply(served.id, turn, kept.keeper(turn)), ask, turn, text)
        if kind == "messages":
            env = Message(served.id, ask.show_thinking)
        elif kind == "responses":
            env = Reply(served.id, turn, kept.keeper(turn))
        elif kind in OLLAMA:
            env = ollama.Reply(served.id, kind == "api_chat")
        elif kind in LLAMA:
            env = llamacpp.Reply(served.id, fill, prompts_of.fim.stops if kind == "infill" else ())
        else:
            env = Envelope(kind, served.id)
        choices = choices_of(run, ask, text)
        for c in choices if ask.echo else ():  # the prompt as sent (token ids: their text)
            given = ask.prompts[c.index // ask.n]
            c.echo = given if isinstance(given, str) else served.tokenizer.decode(given)
        gone = Disconnect(request)
        streaming = False
        try:
            first = await gone.next(run)
            _raise_failed(first[1], ask.kind, ask.policy)
            if ask.stream:
                streaming = True
                gone.stop()
                if kind in OLLAMA:
                    lines = _ndjson(run, first, env, ask, choices)
                    return EventStream(lines, lambda: bridge.finish(run), ollama.STREAM_MEDIA)
                shape = _infill_sse if kind in LLAMA else _sse
                events = (_block_events if kind in BLOCKS else shape)(run, first, env, ask, choices)
                return EventStream(events, lambda: bridge.finish(run))
            async for _, part in _parts(run, first, lambda: gone.next(run), ask, choices):
                if kind in BLOCKS:
                    env.add(part)
            if kind in BLOCKS or kind in OLLAMA:
                return JSONResponse(env.whole(choices[0]))
            if kind in LLAMA:
                return JSONResponse(env.whole(choices))
            return JSONResponse(env.whole(choices, ask.n))
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not streaming:
                gone.stop()
                bridge.finish(run)
                _log(env, ask, choices, run)

    def choices_of(run: Run, ask: Ask, text: str) -> list[Choice]:
        return [
            Choice(
                i,
                reader_for(served.tokenizer, ask.tools),
                # a forced call's answer is all JSON: no reasoning comes apart from it
                None
                if ask.kind in TEXT_KINDS or ask.tools.forced
                else think_reader(served.tokenizer, text),
            )
            for i in range(run.rows)
        ]

    def in_background(run: Run, env: Reply, ask: Ask, turn: Turn, text: str) -> Response:
        """A Responses request with ``background: true``: stored as queued and answered at
        once; the answer runs on, and its stored state (in progress, then completed,
        incomplete, failed or cancelled) is what GET /v1/responses/{id} reads. With
        ``stream: true`` the answer is streamed too, from a log any later GET with
        ``stream=true`` reads again: a dropped connection leaves the answer running."""
        queued = env.snapshot("queued")
        kept.hold(queued, turn)
        log = kept.logs.open(env.id) if ask.stream else None
        note = (lambda events: log.add([event(*e) for e in events])) if log else _ignore
        note(env.queued())
        task = asyncio.ensure_future(answer_in_background(run, env, ask, turn, text, note))
        kept.track(env.id, task, log)
        if log is not None:
            return EventStream(log.read())
        return JSONResponse(queued)

    async def answer_in_background(run: Run, env: Reply, ask: Ask, turn: Turn, text: str, note):
        choices = choices_of(run, ask, text)
        status = "failed"
        error = None
        try:
            first = await run.next()
            _raise_failed(first[1], ask.kind, ask.policy)
            kept.hold(env.snapshot("in_progress"), turn)
            note(env.running())
            async for _, part in _parts(run, first, run.next, ask, choices):
                note(env.add(part))
            note(env.end(choices[0]))  # stores the finished response
            return
        except APIError as e:
            _log_error(env.id, e)
            error = {"code": e.code or "server_error", "message": e.message}
        except asyncio.CancelledError:
            status = "cancelled"
        except Exception as e:  # the task has no caller: its failure is the response's
            error = {"code": "server_error", "message": f"the server failed: {first_line(e)}"}
            print(f"mlxkv: {env.id} failed: {error['message']}", file=sys.stderr, flush=True)
        finally:
            bridge.finish(run)
            _log(env, ask, choices, run)
        ended = {**env.snapshot(status), "error": error}
        if status == "cancelled" and env.done is not None:
            env.done(ended)  # what it wrote is the answer a later turn goes on from
        else:
            kept.hold(ended, turn)
        if status == "failed":
            note(env.failed(ended))

    async def _parts(run: Run, first, next_event, ask: Ask, choices: list[Choice]):
        """``(row, part)`` for what each event of ``run`` adds, from ``first`` on."""
        row, ev = first
        while True:
            for part in _take(choices, row, ev, words, ask, run):
                yield row, part
            if run.open == 0:
                return
            row, ev = await next_event()

    async def _sse(run: Run, first, env: Envelope, ask: Ask, choices: list[Choice]):
        usage = ask.include_usage
        offsets = [0] * run.rows
        try:
            if env.kind == "chat":
                for i in range(run.rows):
                    yield _data(env.chunk([env.opening(i)], usage))
            async for row, part in _parts(run, first, run.next, ask, choices):
                yield _data(env.chunk([env.delta(row, part, offsets[row])], usage))
                offsets[row] += len(part.text)
            if usage:
                yield _data(env.chunk([], True, usage_of(choices, ask.n)))
            yield "data: [DONE]\n\n"
        except APIError as e:
            _log_error(env.id, e)
            yield _data(e.body())
        finally:
            bridge.finish(run)
            _log(env, ask, choices, run)

    async def _block_events(run: Run, first, env, ask: Ask, choices: list[Choice]):
        """A stream of named events, each block or item opened, written and closed:
        Anthropic's (message_start ... message_stop) or Responses' (response.created ...
        response.completed), as ``env`` (a Message or a Reply) makes them."""
        try:
            for e in env.start(getattr(first[1], "stats", None) or Stats()):
                yield event(*e)
            async for _, part in _parts(run, first, run.next, ask, choices):
                for e in env.add(part):
                    yield event(*e)
            for e in env.end(choices[0]):
                yield event(*e)
        except APIError as e:
            _log_error(env.id, e)
            for name, data in env.fail(e):
                yield event(name, data)
        finally:
            bridge.finish(run)
            _log(env, ask, choices, run)

    async def _ndjson(run: Run, first, env: ollama.Reply, ask: Ask, choices: list[Choice]):
        """Ollama's stream: a line of JSON per part of the answer, then the last one (done,
        its reason and timings)."""
        try:
            async for _, part in _parts(run, first, run.next, ask, choices):
                if part.text or part.reasoning or part.calls or part.entry:
                    yield env.line(part)
            yield env.last(choices[0])
        except APIError as e:
            _log_error(env.id, e)
            yield ollama.error_line(e)
        finally:
            bridge.finish(run)
            _log(env, ask, choices, run)

    async def _infill_sse(run: Run, first, env, ask: Ask, choices: list[Choice]):
        """llama.cpp's stream: a ``data:`` line per part of a middle, then each middle's
        last object (its text sent already: ``content`` "")."""
        try:
            async for row, part in _parts(run, first, run.next, ask, choices):
                if part.text:
                    yield _data(env.chunk(part.text, row))
            for c in choices:
                yield _data(env.last(c, ""))
        except APIError as e:
            _log_error(env.id, e)
            yield _data(llamacpp.error_body(e))
        finally:
            bridge.finish(run)
            _log(env, ask, choices, run)

    async def infill(request: Request) -> Response:
        return await completions(request, "infill")

    async def llama_completion(request: Request) -> Response:
        return await completions(request, "llama_completion")

    async def chat_completions(request: Request) -> Response:
        return await completions(request, "chat")

    async def text_completions(request: Request) -> Response:
        return await completions(request, "completion")

    async def messages(request: Request) -> Response:
        return await completions(request, "messages")

    async def responses(request: Request) -> Response:
        return await completions(request, "responses")

    async def embed(request: Request, kind: str) -> Response:
        """OpenAI's ``/v1/embeddings`` ("openai") and Ollama's ``/api/embed`` ("api_embed")
        and ``/api/embeddings`` ("api_embeddings"): each input's vector."""
        gate.auth(request)
        started = time.perf_counter()
        body = parse_json(await gate.body(request))
        width = served.facts.get("embedding_length")
        if kind == "openai":
            ask = embeddings.parse_openai(body, served.limits, width)
        elif kind == "api_embed":
            ask = embeddings.parse_ollama(body, served.limits, width)
        else:
            ask = embeddings.parse_ollama_old(body)
        name = ask.model
        if kind != "openai" and name is not None:  # Ollama's clients add its default tag
            name = ollama.served_name(name, served.serves) or name
        gate.model(name)
        if served.ranks > 1:
            raise APIError(
                400,
                "embeddings are not made by a model split over ranks (mlx.launch); serve "
                "the model on one machine for them",
                "model",
                "embeddings_unsupported",
            )
        prompts = await run_in_threadpool(prompts_of.embedding_ids, ask)
        gone = Disconnect(request)
        try:
            vectors, tokens = await pooled(prompts, gone)
        except ClientGone:
            return Response(status_code=499)
        finally:
            gone.stop()
        vectors = [embeddings.finished(v, ask) for v in vectors]
        print(
            f"mlxkv: {request.url.path} {len(vectors)} embedding(s) of {len(vectors[0])} "
            f"numbers, {tokens} tokens, pooling {served.pooling}",
            file=sys.stderr,
            flush=True,
        )
        if kind == "openai":
            return JSONResponse(embeddings.openai_body(served.id, vectors, tokens, ask.as_base64))
        if kind == "api_embed":
            seconds = time.perf_counter() - started
            return JSONResponse(embeddings.ollama_body(served.id, vectors, tokens, seconds))
        return JSONResponse({"embedding": vectors[0].tolist()})

    async def pooled(prompts: list[list[int]], gone: Disconnect) -> tuple[list, int]:
        """Each prompt's pooled vector and the prompts' tokens, ``max_batch`` prompts in
        flight at a time."""
        s = served.limits.defaults
        settings = GenerationSettings(max_tokens=1, prefill_step=s.prefill_step)
        vectors: list = [None] * len(prompts)
        tokens, step = 0, max(1, served.max_batch)
        for start in range(0, len(prompts), step):
            part = prompts[start : start + step]
            run = bridge.start(part, 1, settings, KVPolicy(), None, embed=served.pooling)
            try:
                while run.open:
                    row, ev = await gone.next(run)
                    _raise_failed(ev, "embeddings")
                    if isinstance(ev, Embedding):
                        vectors[start + row] = ev.vector
                    elif isinstance(ev, Finished):
                        tokens += ev.stats.prompt_tokens
            finally:
                bridge.finish(run)
        return vectors, tokens

    async def api_chat(request: Request) -> Response:
        return await completions(request, "api_chat")

    async def api_generate(request: Request) -> Response:
        return await completions(request, "api_generate")

    routes = [
        Route("/v1/chat/completions", _guard(chat_completions), methods=["POST"]),
        Route("/v1/completions", _guard(text_completions), methods=["POST"]),
        Route("/v1/responses", _guard(responses), methods=["POST"]),
        Route("/v1/responses/input_tokens", _guard(kept.input_tokens), methods=["POST"]),
        Route("/v1/responses/{id}", _guard(kept.one), methods=["GET", "DELETE"]),
        Route("/v1/responses/{id}/input_items", _guard(kept.input_items), methods=["GET"]),
        Route("/v1/responses/{id}/cancel", _guard(kept.cancel), methods=["POST"]),
        Route("/v1/conversations", _guard(talks.create), methods=["POST"]),
        Route("/v1/conversations/{id}", _guard(talks.one), methods=["GET", "POST", "DELETE"]),
        Route("/v1/conversations/{id}/items", _guard(talks.items), methods=["GET", "POST"]),
        Route(
            "/v1/conversations/{id}/items/{item_id}",
            _guard(talks.item),
            methods=["GET", "DELETE"],
        ),
        Route("/v1/files", _guard(batch_api.upload), methods=["POST"]),
        Route("/v1/files", _guard(batch_api.listing), methods=["GET"]),
        Route("/v1/files/{id}", _guard(batch_api.one_file), methods=["GET", "DELETE"]),
        Route("/v1/files/{id}/content", _guard(batch_api.content), methods=["GET"]),
        Route("/v1/batches", _guard(batch_api.create), methods=["POST"]),
        Route("/v1/batches", _guard(batch_api.batches), methods=["GET"]),
        Route("/v1/batches/{id}", _guard(batch_api.one_batch), methods=["GET"]),
        Route("/v1/batches/{id}/cancel", _guard(batch_api.cancel), methods=["POST"]),
        Route("/v1/messages", _guard(messages, error_response), methods=["POST"]),
        Route(
            "/v1/messages/count_tokens",
            _guard(tokens.count_tokens, error_response),
            methods=["POST"],
        ),
        Route("/api/chat", _guard(api_chat, ollama.error_response), methods=["POST"]),
        Route("/api/generate", _guard(api_generate, ollama.error_response), methods=["POST"]),
        Route("/api/tags", _guard(info.api_tags, ollama.error_response), methods=["GET"]),
        Route("/api/ps", _guard(info.api_ps, ollama.error_response), methods=["GET"]),
        Route("/api/show", _guard(info.api_show, ollama.error_response), methods=["POST"]),
        Route("/api/version", _guard(info.api_version, ollama.error_response), methods=["GET"]),
        Route("/infill", _guard(infill, llamacpp.error_response), methods=["POST"]),
        Route("/completion", _guard(llama_completion, llamacpp.error_response), methods=["POST"]),
        Route("/props", _guard(info.props, llamacpp.error_response), methods=["GET"]),
        Route(
            "/apply-template",
            _guard(tokens.apply_template, llamacpp.error_response),
            methods=["POST"],
        ),
        Route("/v1/embeddings", _guard(lambda r: embed(r, "openai")), methods=["POST"]),
        Route(
            "/api/embed",
            _guard(lambda r: embed(r, "api_embed"), ollama.error_response),
            methods=["POST"],
        ),
        Route(
            "/api/embeddings",
            _guard(lambda r: embed(r, "api_embeddings"), ollama.error_response),
            methods=["POST"],
        ),
        Route("/tokenize", _guard(tokens.tokenize), methods=["POST"]),
        Route("/detokenize", _guard(tokens.detokenize), methods=["POST"]),
        Route("/v1/models", _guard(info.models), methods=["GET"]),
        Route("/v1/models/{name:path}", _guard(info.one_model), methods=["GET"]),
        Route("/v1/status", _guard(info.status), methods=["GET"]),
        Route("/metrics", _guard(info.metrics), methods=["GET"]),
        Route("/health", _guard(info.health), methods=["GET"]),
        Route("/", info.root, methods=["GET", "HEAD"]),
    ]
    # Browser pages (a web UI, an editor's webview) may call the API: the preflight is
    # answered and the answers carry CORS headers for the pages that may use it.
    cors = Middleware(
        _CORS,
        anyone=served.api_key is not None,
        allow_methods=["*"],
        allow_headers=["*"],
        max_age=600,
    )
    app = Starlette(
        routes=routes,
        middleware=[cors],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    if runner is not None:
        runner.send = loopback(app, served.api_key)
    app.state.batches = runner
    return app


def _say(line: str) -> None:
    print(f"mlxkv: {line}", file=sys.stderr, flush=True)


class _CORS(CORSMiddleware):
    """CORS for this machine's pages (``is_local_origin``) when the server has no API key,
    for any page when it has one (the key guards it)."""

    def __init__(self, app, anyone: bool, **kwargs):
        super().__init__(app, **kwargs)
        self.anyone = anyone

    def is_allowed_origin(self, origin: str) -> bool:
        return self.anyone or is_local_origin(origin)


def _guard(endpoint, shape=APIError.response):
    """The endpoint with its APIErrors answered in its API's error shape."""

    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as e:
            _log_error(f"{request.method} {request.url.path}", e)
            return shape(e)

    return guarded


def _log_error(where: str, e: APIError) -> None:
    """The reason for an error answer, for whoever reads the server's log: a client (an
    editor, an agent) often shows its user a bare status code. A message can quote the
    request (a model's name): its control characters are written escaped, so a request
    cannot forge log lines or send escape sequences to the terminal, and a long one is cut."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in e.message)
    if len(text) > LOGGED_MESSAGE:
        text = text[: LOGGED_MESSAGE - 3] + "..."
    print(f"mlxkv: {where} {e.status}: {text}", file=sys.stderr, flush=True)


def _take(choices: list[Choice], row: int, ev, words: TokenText, ask: Ask, run: Run) -> list:
    """Record one event of row ``row``; returns the parts a stream sends for it. Raises
    APIError for a failed row."""
    c = choices[row]
    if isinstance(ev, PromptLogprobs):
        c.prompt_logprobs = prompt_entries(words, ev)
        return []
    if isinstance(ev, TokenDelta):
        if ask.warm_only:  # the one token decoded for max_tokens 0 is not the answer's
            return []
        part = c.read(ev.text)
        part.entry = chat_logprob(words, ev) if ask.logprobs is not None else None
        if part.entry is not None:
            c.logprobs.append(part.entry)
        return [part] if part else []
    if isinstance(ev, Finished):
        c.stats = ev.stats
        if ev.finish_reason == "cancelled":
            if run.shutdown:
                raise APIError(
                    503,
                    "the server is shutting down; this answer was cut after "
                    f"{ev.stats.generation_tokens} tokens",
                    code="shutting_down",
                )
            raise APIError(499, "the request was cancelled", code="cancelled")
        held = c.close()
        c.finish_reason, c.stop = ev.finish_reason, ev.stop
        if ask.warm_only:
            c.finish_reason, c.stats = "length", replace(ev.stats, generation_tokens=0)
        return [p for p in (held, Part(reason=c.reason)) if p]
    if isinstance(ev, Failed):
        _raise_failed(ev, ask.kind, ask.policy)
    if isinstance(ev, Notice):
        print(f"mlxkv: {ev.message}", file=sys.stderr, flush=True)
    return []


def _raise_failed(ev, kind: str, policy: KVPolicy | None = None) -> None:
    """A Failed event as the error its request (``kind``; ``policy``: its own) answers."""
    if not isinstance(ev, Failed):
        return
    where = PROMPT_PARAMS.get(kind, "messages")
    if ev.code == "invalid_policy":
        raise APIError(400, ev.message, "kv" if policy else None, "invalid_policy")
    if ev.code == "embeddings_unsupported":
        raise APIError(400, ev.message, "model", ev.code)
    if ev.code == "context_length_exceeded":
        raise APIError(400, api_names(ev.message), where, "context_length_exceeded")
    if ev.code == "invalid_request":
        raise APIError(400, ev.message, where, "invalid_request")
    if ev.code == "invalid_grammar":
        raise APIError(400, ev.message, FORMAT_PARAMS.get(kind), "invalid_schema")
    if ev.code == "kv_budget":
        param = "input" if kind == "embeddings" else "max_tokens"
        raise APIError(400, ev.message, param, "kv_budget_exceeded")
    if ev.code == "shutting_down":  # the bridge ended a row the engine did not
        raise APIError(503, ev.message, None, ev.code)
    if ev.code == "cancelled":
        raise APIError(503, "the server is shutting down; no new requests are taken", None, ev.code)
    raise APIError(500, f"the engine failed: {ev.message}", None, ev.code or "internal")


def _ignore(*_) -> None:
    pass


def _data(obj: dict) -> str:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


def _log(env: Envelope, ask: Ask, choices: list[Choice], run: Run) -> None:
    done = [c for c in choices if c.stats is not None]
    if run.open:
        tokens = sum(len(c.text) for c in choices)
        print(
            f"mlxkv: {env.id} ended after {tokens} tokens, unfinished: its rows are cancelled",
            file=sys.stderr,
            flush=True,
        )
    for c in choices:
        for raw in c.reader.unread if c.reader else ():
            print(
                f"mlxkv: {env.id} answer {c.index}: a tool call the model's parser cannot "
                f"read was sent as text ({len(raw)} characters)",
                file=sys.stderr,
                flush=True,
            )
    if not done:
        return
    s = done[0].stats
    reasons = ",".join(sorted({c.reason or "cancelled" for c in done}))
    who = f" user={ask.user!r}" if ask.user else ""
    kv = (
        f"KV {s.kv_tokens} tokens, {s.kv_bytes_actual} bytes (predicted {s.kv_bytes_predicted})"
        if s.kv_bytes_predicted is not None
        else "no KV (it never started)"
    )
    print(
        f"mlxkv: {env.id} {len(done)} answer(s), {s.prompt_tokens} prompt tokens "
        f"({s.prompt_tokens_cached} cached), {sum(c.stats.generation_tokens for c in done)} "
        f"generated, finish {reasons}; {kv}, {s.policy}{who}",
        file=sys.stderr,
        flush=True,
    )


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404 and request.url.path.startswith("/api/"):
        message = (
            f"no endpoint {request.method} {request.url.path}: this server runs the one model "
            "it started with (it does not pull, push, create, copy or delete models); it has "
            f"{ENDPOINTS}"
        )
    elif exc.status_code == 404:
        message = f"no endpoint {request.method} {request.url.path}; this server has {ENDPOINTS}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return _shaped(request, APIError(exc.status_code, message))


async def _server_error(request: Request, exc: Exception) -> Response:
    print(f"mlxkv: internal error on {request.url.path}: {exc!r}", file=sys.stderr, flush=True)
    return _shaped(request, APIError(500, "internal server error; see the server's log"))


def _shaped(request: Request, e: APIError) -> Response:
    """An error in the shape of the API the path belongs to."""
    if request.url.path.startswith("/v1/messages"):
        return error_response(e)
    if request.url.path.startswith("/api/"):
        return ollama.error_response(e)
    if request.url.path in ("/infill", "/completion", "/props", "/apply-template"):
        return llamacpp.error_response(e)
    return e.response()
