"""OpenAI's Conversations API (``/v1/conversations``): conversations created, read, relabelled
and deleted, and their items added, listed, read and deleted, as the official clients and
the OpenAI Agents SDK's ``OpenAIConversationsSession`` use them. A Responses request with
``conversation`` reads one as the turns before its input (``turns``) and adds its input and
output to it (``keep``)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxkv.server.answers import new_id
from mlxkv.server.conversation_store import Conversation, ConversationStore
from mlxkv.server.errors import APIError, bad
from mlxkv.server.gate import Gate
from mlxkv.server.pages import item_page
from mlxkv.server.responses import input_messages, metadata_of, parse_items


class Conversations:
    """The endpoints, on ``store``, behind the server's ``gate``."""

    def __init__(self, store: ConversationStore, gate: Gate):
        self.store = store
        self.gate = gate

    # -- what a response reads and adds -------------------------------------------------
    def turns(self, conversation_id: str) -> list[dict]:
        """The conversation's items as chat messages, for a response to go on from; a
        404 when it is not held, a 400 when the store has no room for what it would add."""
        conversation = self._get(conversation_id, "conversation")
        if not self.store.fits([]):
            raise _full(self.store)
        return input_messages(conversation.items, written=True)

    def keep(self, conversation_id: str, items: list[dict], response: dict) -> None:
        """A finished response's input items and output, added to its conversation."""
        conversation = self.store.get(conversation_id)
        if conversation is None:
            return
        try:
            self.store.add(conversation, _listed(items) + response["output"])
        except OSError as e:  # the answer stands; its turn is not in the conversation
            print(
                f"mlxkv: {response['id']} not added to {conversation_id}: {_why(e)}",
                file=sys.stderr,
                flush=True,
            )

    # -- endpoints ----------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        """``POST /v1/conversations``: ``items`` and ``metadata``, both optional (so is the
        body)."""
        self.gate.auth(request)
        body = await self.gate.json(request, {})
        _only(body, {"items", "metadata"})
        items = _items(body.get("items"))
        metadata = metadata_of(body.get("metadata"))
        if not self.store.fits(items, metadata):
            raise _full(self.store)
        conversation = Conversation(new_id("conv").replace("-", "_"), metadata, items)
        with _written():
            self.store.create(conversation)
        return JSONResponse(conversation.resource())

    async def one(self, request: Request) -> Response:
        """``GET``, ``POST`` (new ``metadata``) and ``DELETE /v1/conversations/{id}``."""
        self.gate.auth(request)
        conversation = self._get(request.path_params["id"])
        if request.method == "DELETE":
            with _written():
                self.store.delete(conversation.id)
            return JSONResponse(
                {"id": conversation.id, "object": "conversation.deleted", "deleted": True}
            )
        if request.method == "POST":
            body = await self.gate.json(request)
            _only(body, {"metadata"})
            if "metadata" not in body:
                raise bad("metadata is required: the conversation's new labels", "metadata")
            metadata = metadata_of(body["metadata"])
            if not self.store.fits([], metadata):
                raise _full(self.store)
            with _written():
                self.store.set_metadata(conversation, metadata)
        return JSONResponse(conversation.resource())

    async def items(self, request: Request) -> Response:
        """``GET`` (a page) and ``POST`` (``items`` added) ``/v1/conversations/{id}/items``."""
        self.gate.auth(request)
        conversation = self._get(request.path_params["id"])
        if request.method == "GET":
            page = item_page(conversation.items, request.query_params, "this conversation")
            return JSONResponse(page)
        body = await self.gate.json(request)
        _only(body, {"items"})
        if not isinstance(body.get("items"), list) or not body["items"]:
            raise bad("items must be a list of one or more items to add", "items")
        items = _items(body["items"])
        if not self.store.fits(items):
            raise _full(self.store)
        with _written():
            self.store.add(conversation, items)
        return JSONResponse(
            {
                "object": "list",
                "data": items,
                "first_id": items[0]["id"],
                "last_id": items[-1]["id"],
                "has_more": False,
            }
        )

    async def item(self, request: Request) -> Response:
        """``GET`` and ``DELETE /v1/conversations/{id}/items/{item_id}`` (a delete answers
        the conversation)."""
        self.gate.auth(request)
        conversation = self._get(request.path_params["id"])
        item_id = request.path_params["item_id"]
        item = conversation.item(item_id)
        if item is None:
            raise APIError(
                404,
                f"No item found with id '{item_id}' in conversation '{conversation.id}'",
                code="not_found",
            )
        if request.method == "DELETE":
            with _written():
                self.store.remove(conversation, item_id)
            return JSONResponse(conversation.resource())
        return JSONResponse(item)

    def _get(self, conversation_id: str, param: str | None = None) -> Conversation:
        conversation = self.store.get(conversation_id)
        if conversation is None:
            raise APIError(
                404,
                f"No conversation found with id '{conversation_id}': this server keeps "
                "conversations until they are deleted",
                param=param,
                code="not_found",
            )
        return conversation


def _items(v) -> list[dict]:
    """Items to add, each with an id, checked as the chat messages they would become."""
    if v is not None and not isinstance(v, list):
        raise bad("items must be a list of items", "items")
    items = parse_items(v, "items")
    input_messages(items, name="items")
    return _listed(items)


def _listed(items: list[dict]) -> list[dict]:
    """Input items as a conversation lists them: a message it was given is completed."""
    return [{"status": "completed", **i} if i["type"] == "message" else i for i in items]


def _only(body: dict, fields: set[str]) -> None:
    for name in body:
        if name not in fields:
            raise bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")


@contextmanager
def _written():
    """A change the journal could not write is not made, and the client is told why."""
    try:
        yield
    except OSError as e:
        raise APIError(
            500,
            f"the conversation could not be written to its file: {_why(e)}; the change was "
            "not made",
            code="conversation_write_failed",
        ) from None


def _why(e: OSError) -> str:
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


def _full(store: ConversationStore) -> APIError:
    return APIError(
        400,
        f"the conversation store is full ({store.limit // 2**20} MiB of conversations): delete "
        "the conversations or items you no longer need",
        code="conversation_store_full",
    )
