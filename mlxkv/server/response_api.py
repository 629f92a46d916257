"""OpenAI's Responses API around an answer: the conversation a request goes on from
(``previous_response_id``, a ``conversation``), what keeps its answer (the store, its
conversation), the background responses still answering and their event logs, and the
endpoints that count, read, delete and cancel stored responses. The answer itself is the
app's, as for every API."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxkv.server.conversations import Conversations
from mlxkv.server.errors import APIError, bad
from mlxkv.server.event_log import EventLog, EventLogs
from mlxkv.server.gate import Gate
from mlxkv.server.pages import item_page
from mlxkv.server.params import Ask, parse_json
from mlxkv.server.prompts import Prompts
from mlxkv.server.response_store import UNFINISHED, ChainBroken
from mlxkv.server.responses import (
    Turn,
    count_body,
    input_messages,
    not_found,
    parse_responses,
    stream_query,
)
from mlxkv.server.served import Served
from mlxkv.server.stream import EventStream


class ResponseAPI:
    """``served``'s stored responses and ``talks``' conversations, as requests use them."""

    def __init__(self, served: Served, gate: Gate, prompts: Prompts, talks: Conversations):
        self.served, self.gate, self.prompts, self.talks = served, gate, prompts, talks
        self.background: dict[str, asyncio.Task] = {}  # still answering, by id
        self.logs = EventLogs()  # the streamed background responses' events

    # -- what a request goes on from, and what keeps its answer ---------------------------
    def parse(self, body: dict, counting: bool = False) -> tuple[Ask, Turn]:
        return parse_responses(body, self.served.limits, counting=counting, find=self._referenced)

    def _referenced(self, item_id: str, conversation_id: str | None) -> dict | None:
        """The item an ``item_reference`` names: one of the conversation's, or an input or
        output item of a stored response."""
        served = self.served
        conversation = (
            None if conversation_id is None else served.conversations.get(conversation_id)
        )
        found = None if conversation is None else conversation.item(item_id)
        return found or served.stored.item(item_id)

    def with_conversation(self, ask: Ask, turn: Turn) -> Ask:
        """A Responses request's messages with the stored conversation it goes on from
        (``previous_response_id``, or a ``conversation``'s items) between its instructions
        and its input."""
        stored = self.served.stored
        system = ask.messages[: len(ask.messages) - len(turn.messages)]
        if turn.conversation is not None:
            before = self.talks.turns(turn.conversation)
            return replace(ask, messages=system + before + turn.messages)
        if turn.previous is None:
            return ask
        held = stored.get(turn.previous)
        if held is not None and held.response["status"] in UNFINISHED:
            raise bad(
                f"Previous response with id '{turn.previous}' is still "
                f"{held.response['status'].replace('_', ' ')}: wait until GET "
                f"/v1/responses/{turn.previous} says it is completed",
                "previous_response_id",
                "previous_response_not_finished",
            )
        try:
            before = stored.conversation(turn.previous)
        except ChainBroken as e:
            gone = "" if e.missing == e.asked else f" (the response '{e.missing}' before it)"
            raise bad(
                f"Previous response with id '{e.asked}' not found{gone}: this server keeps "
                "stored responses until they are deleted or pushed out by newer ones "
                f"({stored.limit // 2**20} MiB are kept); send the conversation as "
                "input instead",
                "previous_response_id",
                "previous_response_not_found",
            ) from None
        return replace(ask, messages=system + before + turn.messages)

    def keeper(self, turn: Turn):
        """What keeps a finished response: in the store, and in its conversation (None:
        store false and no conversation)."""
        if not turn.store and turn.conversation is None:
            return None

        def keep(response: dict) -> None:
            if turn.conversation is not None:
                self.talks.keep(turn.conversation, turn.items, response)
            if not turn.store:
                return
            try:
                answer = input_messages(response["output"], written=True)
            except APIError:  # a call with no name: nothing a template could go on from
                return
            self._remember(response, turn.items, turn.messages + answer, turn.previous)

        return keep

    def hold(self, response: dict, turn: Turn) -> None:
        """A background response's state before its answer is whole (its turn without the
        answer); the finished response replaces it through ``keeper``."""
        self._remember(response, turn.items, turn.messages, turn.previous)

    def _remember(self, response: dict, items: list, messages: list, previous) -> None:
        """A response stored; where its file cannot be written it is kept in memory only."""
        stored = self.served.stored
        try:
            stored.put(response, items, messages, previous)
        except OSError as e:
            print(
                f"mlxkv: {response['id']} is stored in memory only: its file: {e.strerror or e}",
                file=sys.stderr,
                flush=True,
            )
            stored.put(response, items, messages, previous, written=True)

    # -- background responses -------------------------------------------------------------
    def track(self, response_id: str, task: asyncio.Task, log: EventLog | None) -> None:
        """A background response's task, held until it ends (its log then ended too)."""
        self.background[response_id] = task

        def ended(_) -> None:
            self.background.pop(response_id, None)
            if log is not None:
                log.end()
                self.logs.trim()

        task.add_done_callback(ended)

    async def _stop_background(self, response_id: str) -> None:
        """A background response still answering stops, and is stored as cancelled."""
        task = self.background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})

    # -- endpoints --------------------------------------------------------------------------
    async def input_tokens(self, request: Request) -> Response:
        """``POST /v1/responses/input_tokens``: the tokens the request's prompt renders to."""
        self.gate.auth(request)
        body = parse_json(await self.gate.body(request))
        ask, turn = self.parse(body, counting=True)
        self.gate.model(ask.model)
        self.prompts.check_tool_format(ask)
        ask = self.with_conversation(ask, turn)
        render = self.prompts.render
        use = self.prompts.truncated if turn.truncate else lambda a: (a, render(a))
        _, (prompts, _) = await run_in_threadpool(use, ask)
        return JSONResponse(count_body(len(prompts[0])))

    def _stored(self, request: Request):
        entry = self.served.stored.get(request.path_params["id"])
        if entry is None:
            raise not_found(request.path_params["id"])
        return entry

    async def one(self, request: Request) -> Response:
        """``GET`` (whole, or its events again with ``stream=true``) and ``DELETE
        /v1/responses/{id}``."""
        self.gate.auth(request)
        response_id = request.path_params["id"]
        if request.method == "DELETE":
            await self._stop_background(response_id)  # or its end would store it again
            try:
                if not self.served.stored.delete(response_id):
                    raise not_found(response_id)
            except OSError as e:
                raise APIError(
                    500,
                    f"the response's file could not be removed: {e.strerror or e}; it was not "
                    "deleted",
                    code="response_write_failed",
                ) from None
            self.logs.drop(response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
        entry = self._stored(request)
        after = stream_query(request.query_params)
        if after is None:
            return JSONResponse(entry.response)
        log = self.logs.get(response_id)
        if log is None:
            raise bad(
                f"the events of response '{entry.response['id']}' are not kept: only background "
                "responses created with stream: true can be streamed again (the latest "
                f"{self.logs.limit // 2**20} MiB of their events are kept, in memory); read it "
                "without stream=true",
                "stream",
            )
        return EventStream(log.read(after))

    async def input_items(self, request: Request) -> Response:
        """The stored input items of a response, a page at a time (``limit``, ``order``,
        ``after``), as OpenAI's API lists them."""
        self.gate.auth(request)
        of = "this response's input"
        return JSONResponse(item_page(self._stored(request).items, request.query_params, of))

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/responses/{id}/cancel``: a background response stops where it is and
        is stored as cancelled (one already ended is answered as it is)."""
        self.gate.auth(request)
        entry = self._stored(request)
        if not entry.response.get("background"):
            raise bad("only background responses can be cancelled", "response_id")
        await self._stop_background(request.path_params["id"])
        return JSONResponse(self._stored(request).response)
