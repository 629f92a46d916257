"""The HTTP API (Starlette): OpenAI's chat and text completions, responses and embeddings,
Anthropic's messages, Ollama's chat, generate and embed, models, health, status, metrics."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from fnmatch import fnmatchcase

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxkv import __version__
from mlxkv.engine.events import (
    Embedding,
    Failed,
    Finished,
    Notice,
    PromptLogprobs,
    Stats,
    TokenDelta,
)
from mlxkv.engine.request import (
    RESERVE_STEP,
    GenerationSettings,
    encode_prompt,
    encode_text,
    most_prompt_characters,
)
from mlxkv.errors import UserError, first_line
from mlxkv.models.fim import fim_format, has_tokens, infill_ids
from mlxkv.policy import KVPolicy
from mlxkv.server import embeddings, llamacpp, metrics, ollama
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
from mlxkv.server.conversation_store import ConversationStore
from mlxkv.server.conversations import Conversations
from mlxkv.server.errors import APIError, bad
from mlxkv.server.event_log import EventLogs
from mlxkv.server.file_store import FileStore
from mlxkv.server.local import foreign_source, is_local_origin
from mlxkv.server.messages import Message, error_response, event, parse_messages
from mlxkv.server.pages import item_page
from mlxkv.server.params import (
    Ask,
    Limits,
    api_names,
    model_of,
    parse_chat,
    parse_completion,
    parse_json,
)
from mlxkv.server.reasoning import think_reader
from mlxkv.server.response_store import UNFINISHED, ChainBroken, ResponseStore
from mlxkv.server.responses import (
    Reply,
    Turn,
    count_body,
    input_messages,
    not_found,
    parse_responses,
    stream_query,
)
from mlxkv.server.tokenize import (
    detokenize_body,
    parse_detokenize,
    parse_tokenize,
    tokenize_body,
)
from mlxkv.server.tools import has_tool_calling, held_calls, reader_for
from mlxkv.server.truncation import answer_room, fitted

ENDPOINTS = (
    "/v1/chat/completions, /v1/completions, /v1/responses, /v1/conversations, /v1/messages, "
    "/v1/messages/count_tokens, /v1/embeddings, /v1/models, /v1/status, /metrics, /health, "
    "/tokenize, /detokenize, llama.cpp's /completion, /infill, /props and /apply-template, "
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
# what a request can do instead, in each API's words (OpenAI's: chat and responses)
NO_TOOLS = {
    "openai": "leave 'tools' out, send tool_choice 'none', or force a call (tool_choice "
    "'required' or a function's name)",
    "messages": "leave 'tools' out, or send tool_choice {type: 'none'}, or force a call "
    "({type: 'any'} or {type: 'tool', name})",
    "api_chat": "leave 'tools' out",
}
FORMAT_PARAMS = {  # where each API asks for an answer's schema
    "chat": "response_format",
    "responses": "text.format",
    "messages": "output_config.format",
    "api_chat": "format",
    "api_generate": "format",
}
BLOCKS = ("messages", "responses")  # one answer, as a list of blocks or items
BODY_WAIT = 30.0  # seconds a request body may pause before it gets 408
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


@dataclass
class Served:
    """The one model this server runs and the rules it runs it by."""

    id: str  # the name /v1/models lists
    names: set[str]  # every name a request's ``model`` may give (alias, repo id)
    tokenizer: object  # chat template and token texts (no MLX)
    policy: KVPolicy  # the default KV policy
    patterns: tuple[str, ...] = ()  # shell patterns of more names ('claude-*', '*')
    limits: Limits = field(default_factory=Limits)
    max_batch: int = 16
    batch_requests: int = 15  # a batch's requests in flight at once (/v1/batches)
    ranks: int = 1  # processes the model is split over (mlx.launch); rank 0 serves
    api_key: str | None = None
    max_body: int = 8 * 2**20
    stored: ResponseStore = field(default_factory=ResponseStore)  # Responses' store: true
    conversations: ConversationStore = field(default_factory=ConversationStore)
    files: FileStore | None = None  # uploads and batch results (None: no files, no batches)
    facts: dict = field(default_factory=dict)  # size, family, context... (Ollama's listings)
    pooling: str = "last"  # how an embedding pools the final hidden states: "last", "mean"
    started: int = field(default_factory=lambda: int(time.time()))

    def serves(self, name: str) -> bool:
        return name in self.names or any(fnmatchcase(name, p) for p in self.patterns)


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
    background: dict[str, asyncio.Task] = {}  # background responses still answering, by id
    logs = EventLogs()  # the streamed background responses' events
    fim = fim_format(served.tokenizer)  # read once: it walks the whole vocabulary
    repo_level = fim is not None and has_tokens(served.tokenizer, fim.repo, fim.file_sep)

    def check_auth(request: Request) -> None:
        if served.api_key is None:
            check_local(request)
            return
        # OpenAI's clients send "Authorization: Bearer KEY", Anthropic's "x-api-key: KEY"
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            key = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(key.strip().encode(), served.api_key.encode()):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer KEY' (or "
                "'x-api-key: KEY') with the key the server was started with (--api-key or "
                "MLXKV_API_KEY)",
                code="invalid_api_key",
            )

    async def read_json(request: Request, empty: dict | None = None) -> dict:
        """The body as a JSON object (``empty`` stands for a body with nothing in it)."""
        raw = await read_body(request)
        return dict(empty) if empty is not None and not raw.strip() else parse_json(raw)

    talks = Conversations(served.conversations, check_auth, read_json)
    runner = None
    if served.files is not None:
        runner = BatchRunner(served.files, None, served.batch_requests, _say, served.max_body)
        runner.load()
    batch_api = BatchAPI(served.files, runner, served.id, check_auth, read_json)

    def check_local(request: Request) -> None:
        why = foreign_source(request.headers.get("host"), request.headers.get("origin"))
        if why is not None:
            raise APIError(
                403,
                f"this server has no API key, so it answers this machine only ({why}); "
                "start it with --api-key to take requests from elsewhere",
                code="forbidden_origin",
            )

    async def read_body(request: Request) -> bytes:
        limit = served.max_body
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

    def check_model(name: str | None) -> None:
        if name is not None and not served.serves(name):
            raise APIError(
                404,
                f"The model '{name}' does not exist on this server: it serves '{served.id}' "
                "(GET /v1/models); the model is chosen when mlxkv serve starts "
                "(--served-model-name gives it more names)",
                param="model",
                code="model_not_found",
            )

    def render(ask: Ask, answer: bool = True) -> tuple[list[list[int]], str]:
        """The prompts as token ids (the chat template applied), and a chat prompt's text
        (not ``answer``: the messages as the start of a longer prompt); runs in a worker
        thread."""

        def encode(text: str) -> list[int]:
            try:
                return bridge.scheduler.encode(text)
            except UserError as e:  # the tokenizer failed on this text
                raise bad(str(e), "messages" if ask.messages else "prompt") from None

        if ask.kind in ("completion", *LLAMA):
            return [p if isinstance(p, list) else encode(p) for p in ask.prompts], ""
        tools = {"tools": ask.tools.tools} if ask.tools.on else {}
        # a last assistant message is the start of the answer: the template leaves it open
        go_on = ask.continue_final and answer
        ending = {"continue_final_message": True} if go_on else {}
        try:
            text = served.tokenizer.apply_chat_template(
                ask.messages,
                tokenize=False,
                add_generation_prompt=answer and not go_on,
                **ending,
                **tools,
                **ask.template_kwargs,
            )
        except Exception as e:  # the template refused these messages or arguments
            raise bad(f"the chat template cannot render these messages: {e}", "messages") from None
        if not isinstance(text, str):
            raise bad("chat_template_kwargs made the template return no text", "messages")
        return [encode(text)], text

    def truncated(ask: Ask) -> tuple[Ask, tuple[list[list[int]], str]]:
        """A Responses request without the oldest turns that keep its conversation from
        fitting the model's context with room for the answer (``truncation: "auto"``), and
        its render; runs in a worker thread."""
        context = served.limits.context_length
        if not context or (ask.policy or served.policy).window is not None:
            return ask, render(ask)  # a window takes a prompt of any length
        renders = {}  # by length: what is kept is the instructions and a suffix

        def count(messages: list[dict], whole: bool) -> int | None:
            if whole:
                renders[len(messages)] = render(replace(ask, messages=messages))
                return len(renders[len(messages)][0][0])
            try:
                return len(render(replace(ask, messages=messages), answer=False)[0][0])
            except APIError:  # a template that renders no conversation cut short
                return None

        s = ask.settings
        room = context - answer_room(RESERVE_STEP if s.open_ended else s.max_tokens, context)
        kept = fitted(ask.messages, count, room)
        if kept is None:
            raise APIError(
                400,
                f"even the input's last turn does not fit the model's context ({context} "
                f"tokens) with room for the answer ({context - room}): shorten it or send a "
                "smaller max_output_tokens",
                "input",
                "context_length_exceeded",
            )
        ask = replace(ask, messages=kept)
        return ask, renders.get(len(kept)) or render(ask)

    def with_conversation(ask: Ask, turn: Turn) -> Ask:
        """A Responses request's messages with the stored conversation it goes on from
        (``previous_response_id``, or a ``conversation``'s items) between its instructions
        and its input."""
        system = ask.messages[: len(ask.messages) - len(turn.messages)]
        if turn.conversation is not None:
            before = talks.turns(turn.conversation)
            return replace(ask, messages=system + before + turn.messages)
        if turn.previous is None:
            return ask
        held = served.stored.get(turn.previous)
        if held is not None and held.response["status"] in UNFINISHED:
            raise bad(
                f"Previous response with id '{turn.previous}' is still "
                f"{held.response['status'].replace('_', ' ')}: wait until GET "
                f"/v1/responses/{turn.previous} says it is completed",
                "previous_response_id",
                "previous_response_not_finished",
            )
        try:
            before = served.stored.conversation(turn.previous)
        except ChainBroken as e:
            gone = "" if e.missing == e.asked else f" (the response '{e.missing}' before it)"
            raise bad(
                f"Previous response with id '{e.asked}' not found{gone}: this server keeps "
                "stored responses until they are deleted or pushed out by newer ones "
                f"({served.stored.limit // 2**20} MiB are kept); send the conversation as "
                "input instead",
                "previous_response_id",
                "previous_response_not_found",
            ) from None
        return replace(ask, messages=system + before + turn.messages)

    def referenced(item_id: str, conversation_id: str | None) -> dict | None:
        """The item an ``item_reference`` names: one of the conversation's, or an input or
        output item of a stored response."""
        conversation = (
            None if conversation_id is None else served.conversations.get(conversation_id)
        )
        found = None if conversation is None else conversation.item(item_id)
        return found or served.stored.item(item_id)

    def keeper(turn: Turn):
        """What keeps a finished response: in the store, and in its conversation (None:
        store false and no conversation)."""
        if not turn.store and turn.conversation is None:
            return None

        def keep(response: dict) -> None:
            if turn.conversation is not None:
                talks.keep(turn.conversation, turn.items, response)
            if not turn.store:
                return
            try:
                answer = input_messages(response["output"], written=True)
            except APIError:  # a call with no name: nothing a template could go on from
                return
            remember(response, turn.items, turn.messages + answer, turn.previous)

        return keep

    def remember(response: dict, items: list, messages: list, previous: str | None) -> None:
        """A response stored; where its file cannot be written it is kept in memory only."""
        try:
            served.stored.put(response, items, messages, previous)
        except OSError as e:
            _say(f"{response['id']} is stored in memory only: its file: {e.strerror or e}")
            served.stored.put(response, items, messages, previous, written=True)

    async def completions(request: Request, kind: str) -> Response:
        check_auth(request)
        body = parse_json(await read_body(request))
        if kind == "responses":
            ask, turn = parse_responses(body, served.limits, find=referenced)
        elif kind in LLAMA:
            ask, fill = llamacpp.parse_infill(body, served.limits, kind == "infill")
        else:
            ask = PARSERS[kind](body, served.limits)
        if kind in OLLAMA:  # Ollama's clients add its default tag to a name
            ask = replace(ask, model=ollama.served_name(ask.model, served.serves) or ask.model)
        check_model(ask.model)
        check_tool_format(ask)
        if (held := held_calls(ask.tools, served.tokenizer)) is not None:
            ask = replace(ask, settings=replace(ask.settings, call_grammar=held))
        rendered = None
        if kind == "responses":
            ask = with_conversation(ask, turn)
            if turn.truncate:
                ask, rendered = await run_in_threadpool(truncated, ask)
        if ask.suffix is not None:
            ask = fill_in(ask)
        if kind == "infill":
            ask = await run_in_threadpool(infill_prompt, ask, fill)
        if kind in OLLAMA and not (ask.messages or ask.prompts):
            # nothing to answer: a client making sure the model is loaded (it always is)
            return JSONResponse(ollama.Reply(served.id, kind == "api_chat").loaded())
        prompts, text = rendered or await run_in_threadpool(render, ask)
        predicted = None
        if ask.prediction:
            predicted = await run_in_threadpool(prediction_ids, ask.prediction)
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
            return in_background(run, Reply(served.id, turn, keeper(turn)), ask, turn, text)
        if kind == "messages":
            env = Message(served.id, ask.show_thinking)
        elif kind == "responses":
            env = Reply(served.id, turn, keeper(turn))
        elif kind in OLLAMA:
            env = ollama.Reply(served.id, kind == "api_chat")
        elif kind in LLAMA:
            env = llamacpp.Reply(served.id, fill, fim.stops if kind == "infill" else ())
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
                    return _Stream(lines, lambda: bridge.finish(run), ollama.STREAM_MEDIA)
                shape = _infill_sse if kind in LLAMA else _sse
                events = (_block_events if kind in BLOCKS else shape)(run, first, env, ask, choices)
                return _Stream(events, lambda: bridge.finish(run))
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
                if ask.kind in ("completion", *LLAMA) or ask.tools.forced
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
        hold(queued, turn)
        log = logs.open(env.id) if ask.stream else None
        note = (lambda events: log.add([event(*e) for e in events])) if log else _ignore
        note(env.queued())
        task = asyncio.ensure_future(answer_in_background(run, env, ask, turn, text, note))
        background[env.id] = task

        def ended(_) -> None:
            background.pop(env.id, None)
            if log is not None:
                log.end()
                logs.trim()

        task.add_done_callback(ended)
        if log is not None:
            return _Stream(log.read(), _ignore)
        return JSONResponse(queued)

    async def answer_in_background(run: Run, env: Reply, ask: Ask, turn: Turn, text: str, note):
        choices = choices_of(run, ask, text)
        status = "failed"
        error = None
        try:
            first = await run.next()
            _raise_failed(first[1], ask.kind, ask.policy)
            hold(env.snapshot("in_progress"), turn)
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
            hold(ended, turn)
        if status == "failed":
            note(env.failed(ended))

    def hold(response: dict, turn: Turn) -> None:
        """A background response's state before its answer is whole (its turn without the
        answer); the finished response replaces it through ``keeper``."""
        remember(response, turn.items, turn.messages, turn.previous)

    async def cancel_response(request: Request) -> Response:
        """``POST /v1/responses/{id}/cancel``: a background response stops where it is and
        is stored as cancelled (one already ended is answered as it is)."""
        check_auth(request)
        entry = stored(request)
        if not entry.response.get("background"):
            raise bad("only background responses can be cancelled", "response_id")
        await stop_background(request.path_params["id"])
        return JSONResponse(stored(request).response)

    async def stop_background(response_id: str) -> None:
        """A background response still answering stops, and is stored as cancelled."""
        task = background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})

    def fill_in(ask: Ask) -> Ask:
        """A completion with a suffix as the model's fill-in-the-middle prompts, which end
        where the model writes one of the format's markers."""
        if fim is None:
            raise APIError(
                400,
                f"suffix: the model '{served.id}' has no fill-in-the-middle tokens (as code "
                "models such as Qwen2.5-Coder, StarCoder2, DeepSeek-Coder and Codestral have); "
                "leave suffix out",
                param="suffix",
                code="fim_unsupported",
            )
        prompts = [fim.prompt(p, ask.suffix) for p in ask.prompts]
        return replace(ask, prompts=prompts, settings=ending_at_markers(ask.settings))

    def ending_at_markers(settings):
        """``settings`` whose answer (a middle) also ends at the FIM format's markers."""
        return replace(settings, stop=tuple(dict.fromkeys((*settings.stop, *fim.stops))))

    def infill_prompt(ask: Ask, infill: llamacpp.Infill) -> Ask:
        """An /infill request's prompt, laid out as llama.cpp lays it out; its middle ends
        where the model writes one of the format's markers. Runs in a worker thread."""
        if fim is None:
            raise APIError(
                400,
                f"the model '{served.id}' has no fill-in-the-middle tokens (as code models "
                "such as Qwen2.5-Coder, StarCoder2, DeepSeek-Coder and Codestral have), so "
                "/infill cannot run on it; serve a code model",
                code="fim_unsupported",
            )
        answer = -1 if ask.settings.open_ended else ask.settings.max_tokens
        limit = served.limits.context_length
        ids, infill.truncated = infill_ids(
            served.tokenizer, fim, repo_level, infill.text, answer, limit
        )
        return replace(ask, prompts=[ids], settings=ending_at_markers(ask.settings))

    def check_tool_format(ask: Ask) -> None:
        """Tools the model may call need its family's call format; a forced call does not
        (it is written as JSON held to the schema, whatever the family)."""
        if ask.tools.on and not ask.tools.forced and not has_tool_calling(served.tokenizer):
            raise APIError(
                400,
                f"the model '{served.id}' cannot call tools: its chat template has no "
                f"tool-call format mlx-lm knows; {NO_TOOLS.get(ask.kind, NO_TOOLS['openai'])}",
                param="tools",
                code="tools_unsupported",
            )

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

    async def input_tokens(request: Request) -> Response:
        check_auth(request)
        body = parse_json(await read_body(request))
        ask, turn = parse_responses(body, served.limits, counting=True, find=referenced)
        check_model(ask.model)
        check_tool_format(ask)
        ask = with_conversation(ask, turn)
        use = truncated if turn.truncate else lambda a: (a, render(a))
        _, (prompts, _) = await run_in_threadpool(use, ask)
        return JSONResponse(count_body(len(prompts[0])))

    def stored(request: Request):
        entry = served.stored.get(request.path_params["id"])
        if entry is None:
            raise not_found(request.path_params["id"])
        return entry

    async def one_response(request: Request) -> Response:
        check_auth(request)
        if request.method == "DELETE":
            await stop_background(request.path_params["id"])  # or its end would store it again
            try:
                if not served.stored.delete(request.path_params["id"]):
                    raise not_found(request.path_params["id"])
            except OSError as e:
                raise APIError(
                    500,
                    f"the response's file could not be removed: {e.strerror or e}; it was not "
                    "deleted",
                    code="response_write_failed",
                ) from None
            logs.drop(request.path_params["id"])
            deleted = {"object": "response.deleted", "deleted": True}
            return JSONResponse({"id": request.path_params["id"], **deleted})
        entry = stored(request)
        after = stream_query(request.query_params)
        if after is None:
            return JSONResponse(entry.response)
        log = logs.get(request.path_params["id"])
        if log is None:
            raise bad(
                f"the events of response '{entry.response['id']}' are not kept: only background "
                "responses created with stream: true can be streamed again (the latest "
                f"{logs.limit // 2**20} MiB of their events are kept, in memory); read it without "
                "stream=true",
                "stream",
            )
        return _Stream(log.read(after), _ignore)

    async def input_items(request: Request) -> Response:
        """The stored input items of a response, a page at a time (``limit``, ``order``,
        ``after``), as OpenAI's API lists them."""
        check_auth(request)
        of = "this response's input"
        return JSONResponse(item_page(stored(request).items, request.query_params, of))

    async def tokenize(request: Request) -> Response:
        check_auth(request)
        body = parse_json(await read_body(request))
        ask = parse_tokenize(body)
        check_model(model_of(body))
        if ask.form == "messages":
            chat = parse_chat(ask.chat, served.limits)
            check_tool_format(chat)
            prompts, _ = await run_in_threadpool(render, chat, ask.generation_prompt)
            ids = prompts[0]
        else:
            try:
                ids = await run_in_threadpool(
                    encode_prompt, served.tokenizer, ask.text, ask.specials
                )
            except UserError as e:  # the tokenizer failed on this text
                raise bad(str(e), ask.form) from None
        context = served.limits.context_length
        return JSONResponse(tokenize_body(ask, ids, words, context))

    async def embed(request: Request, kind: str) -> Response:
        """OpenAI's ``/v1/embeddings`` ("openai") and Ollama's ``/api/embed`` ("api_embed")
        and ``/api/embeddings`` ("api_embeddings"): each input's vector."""
        check_auth(request)
        started = time.perf_counter()
        body = parse_json(await read_body(request))
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
        check_model(name)
        if served.ranks > 1:
            raise APIError(
                400,
                "embeddings are not made by a model split over ranks (mlx.launch); serve "
                "the model on one machine for them",
                "model",
                "embeddings_unsupported",
            )
        prompts = await run_in_threadpool(embedding_ids, ask)
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

    def embedding_ids(ask: embeddings.EmbedAsk) -> list[list[int]]:
        """Each input's token ids as the model's tokenizer makes them for itself (with the
        markers it adds: an embedding model's end of text), each within the context (cut to
        it when the request says ``truncate``); runs in a worker thread."""
        out, context = [], served.limits.context_length
        most = most_characters()

        def too_long(i: int, size: str) -> APIError:
            where = f"input[{i}]" if len(ask.inputs) > 1 else "input"
            return APIError(
                400,
                f"{where} has {size} but the model's context is {context} tokens; shorten it",
                "input",
                "context_length_exceeded",
            )

        for i, p in enumerate(ask.inputs):
            if isinstance(p, str) and most is not None and len(p) > most:
                if not ask.truncate:  # refused before the tokenizer reads it all
                    raise too_long(i, f"{len(p)} characters")
                p = p[:most]
            try:
                ids = p if isinstance(p, list) else encode_text(served.tokenizer, p, True)
            except UserError as e:  # the tokenizer failed on this text
                raise bad(str(e), "input") from None
            if context and len(ids) >= context:
                if not ask.truncate:
                    raise too_long(i, f"{len(ids)} tokens")
                ids = ids[: context - 1]
            out.append(ids)
        return out

    def prediction_ids(text: str) -> list[int]:
        """A predicted output's token ids (no markers added), refused past what the context
        could hold before the tokenizer reads it all; runs in a worker thread."""
        most = most_characters()
        if most is not None and len(text) > most:
            raise APIError(
                400,
                f"prediction has {len(text)} characters, more than an answer in a "
                f"{served.limits.context_length}-token context can hold; shorten it",
                "prediction",
                "context_length_exceeded",
            )
        try:
            return encode_text(served.tokenizer, text, False)
        except UserError as e:  # the tokenizer failed on this text
            raise bad(str(e), "prediction") from None

    @functools.cache
    def most_characters() -> int | None:
        """Characters no input can exceed and fit the context (read once: it walks the
        vocabulary)."""
        return most_prompt_characters(served.tokenizer, served.limits.context_length)

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

    async def props(request: Request) -> Response:
        check_auth(request)
        return JSONResponse(
            llamacpp.props_body(
                served.id,
                served.limits,
                served.tokenizer,
                served.max_batch,
                f"mlxkv {__version__}",
            )
        )

    async def apply_template(request: Request) -> Response:
        """llama.cpp's ``/apply-template``: ``{"messages", "tools"?, ...}`` as the chat
        template renders it for an answer, ``{"prompt": TEXT}``."""
        check_auth(request)
        body = parse_json(await read_body(request))
        for name in body:
            if name not in ("model", "messages", "tools", "tool_choice", "chat_template_kwargs"):
                raise bad(f"{name} is not a field of /apply-template; send messages", name)
        chat = parse_chat(body, served.limits)
        check_model(chat.model)
        check_tool_format(chat)
        _, text = await run_in_threadpool(render, chat)
        return JSONResponse({"prompt": text})

    async def detokenize(request: Request) -> Response:
        check_auth(request)
        body = parse_json(await read_body(request))
        ids = parse_detokenize(body, served.limits.vocab_size)
        check_model(model_of(body))
        text = await run_in_threadpool(served.tokenizer.decode, ids)
        return JSONResponse(detokenize_body(text))

    async def count_tokens(request: Request) -> Response:
        check_auth(request)
        ask = parse_messages(parse_json(await read_body(request)), served.limits, counting=True)
        check_model(ask.model)
        check_tool_format(ask)
        prompts, _ = await run_in_threadpool(render, ask)
        return JSONResponse({"input_tokens": len(prompts[0])})

    async def api_chat(request: Request) -> Response:
        return await completions(request, "api_chat")

    async def api_generate(request: Request) -> Response:
        return await completions(request, "api_generate")

    def modified() -> str:
        return datetime.fromtimestamp(served.started, timezone.utc).isoformat()

    async def api_tags(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"models": [ollama.listing(served.id, served.facts, modified())]})

    async def api_ps(request: Request) -> Response:
        check_auth(request)
        loaded = ollama.listing(served.id, served.facts, modified())
        loaded.update(
            expires_at=None,  # loaded while the server runs
            size_vram=served.facts.get("size", 0),  # unified memory: all of it
            context_length=served.facts.get("context_length"),
        )
        return JSONResponse({"models": [loaded]})

    async def api_show(request: Request) -> Response:
        check_auth(request)
        body = parse_json(await read_body(request))
        for k in body:
            if k not in ("model", "name", "verbose"):
                raise bad(f"{k} is not a field of this request; send model", k)
        name = body.get("model") or body.get("name")
        if not isinstance(name, str):
            raise bad("model is required", "model")
        check_model(ollama.served_name(name, served.serves) or name)
        tok = served.tokenizer
        abilities = ["completion"]
        abilities += ["tools"] if has_tool_calling(tok) else []
        abilities += ["thinking"] if getattr(tok, "has_thinking", False) else []
        abilities += ["insert"] if fim is not None else []  # fill-in-the-middle
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
                "modified_at": modified(),
            }
        )

    async def api_version(request: Request) -> Response:
        return JSONResponse({"version": ollama.API_VERSION})

    def model_card() -> dict:
        """The served model as both APIs list one (OpenAI's fields, then Anthropic's), and
        its context as vLLM lists it (``max_model_len``) and OpenRouter (``context_length``,
        which llama.vscode and other clients look for), which clients read to size their
        prompts."""
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

    async def models(request: Request) -> Response:
        check_auth(request)
        listed = {"object": "list", "data": [model_card()]}
        paging = {"has_more": False, "first_id": served.id, "last_id": served.id}
        return JSONResponse({**listed, **paging})

    async def one_model(request: Request) -> Response:
        check_auth(request)
        check_model(request.path_params["name"])
        return JSONResponse(model_card())

    async def root(request: Request) -> Response:
        """What Ollama's clients probe before they talk to a server (``GET``/``HEAD /``)."""
        return PlainTextResponse("mlxkv is running")

    async def health(request: Request) -> Response:
        if bridge.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok", "model": served.id})

    def status_now() -> dict:
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
            "batches": None if runner is None else runner.usage(),
        }

    async def status(request: Request) -> Response:
        check_auth(request)
        return JSONResponse(status_now())

    scrape = metrics.registry(status_now)

    async def metrics_text(request: Request) -> Response:
        check_auth(request)
        body, content_type = metrics.exposition(scrape)
        return Response(body, media_type=content_type)

    routes = [
        Route("/v1/chat/completions", _guard(chat_completions), methods=["POST"]),
        Route("/v1/completions", _guard(text_completions), methods=["POST"]),
        Route("/v1/responses", _guard(responses), methods=["POST"]),
        Route("/v1/responses/input_tokens", _guard(input_tokens), methods=["POST"]),
        Route("/v1/responses/{id}", _guard(one_response), methods=["GET", "DELETE"]),
        Route("/v1/responses/{id}/input_items", _guard(input_items), methods=["GET"]),
        Route("/v1/responses/{id}/cancel", _guard(cancel_response), methods=["POST"]),
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
        Route("/v1/messages/count_tokens", _guard(count_tokens, error_response), methods=["POST"]),
        Route("/api/chat", _guard(api_chat, ollama.error_response), methods=["POST"]),
        Route("/api/generate", _guard(api_generate, ollama.error_response), methods=["POST"]),
        Route("/api/tags", _guard(api_tags, ollama.error_response), methods=["GET"]),
        Route("/api/ps", _guard(api_ps, ollama.error_response), methods=["GET"]),
        Route("/api/show", _guard(api_show, ollama.error_response), methods=["POST"]),
        Route("/api/version", _guard(api_version, ollama.error_response), methods=["GET"]),
        Route("/infill", _guard(infill, llamacpp.error_response), methods=["POST"]),
        Route("/completion", _guard(llama_completion, llamacpp.error_response), methods=["POST"]),
        Route("/props", _guard(props, llamacpp.error_response), methods=["GET"]),
        Route("/apply-template", _guard(apply_template, llamacpp.error_response), methods=["POST"]),
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
        Route("/tokenize", _guard(tokenize), methods=["POST"]),
        Route("/detokenize", _guard(detokenize), methods=["POST"]),
        Route("/v1/models", _guard(models), methods=["GET"]),
        Route("/v1/models/{name:path}", _guard(one_model), methods=["GET"]),
        Route("/v1/status", _guard(status), methods=["GET"]),
        Route("/metrics", _guard(metrics_text), methods=["GET"]),
        Route("/health", _guard(health), methods=["GET"]),
        Route("/", root, methods=["GET", "HEAD"]),
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


class _Stream(StreamingResponse):
    """A streamed answer (server-sent events, or Ollama's NDJSON); ``on_close`` runs however the
    response ends (even when the client leaves before the first event is sent)."""

    def __init__(self, events, on_close, media_type: str = "text/event-stream"):
        super().__init__(
            events,
            media_type=media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


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
