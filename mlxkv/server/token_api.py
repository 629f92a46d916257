"""The endpoints that count and show tokens without answering: vLLM's and llama.cpp's
``/tokenize`` and ``/detokenize``, llama.cpp's ``/apply-template`` and Anthropic's
``/v1/messages/count_tokens``."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxkv.engine.request import encode_prompt
from mlxkv.errors import UserError
from mlxkv.server.answers import TokenText
from mlxkv.server.errors import bad
from mlxkv.server.gate import Gate
from mlxkv.server.messages import parse_messages
from mlxkv.server.params import model_of, parse_chat, parse_json
from mlxkv.server.prompts import Prompts
from mlxkv.server.served import Served
from mlxkv.server.tokenize import (
    detokenize_body,
    parse_detokenize,
    parse_tokenize,
    tokenize_body,
)

TEMPLATE_FIELDS = ("model", "messages", "tools", "tool_choice", "chat_template_kwargs")


class TokenAPI:
    """The endpoints, on ``served``'s tokenizer and ``prompts``' rendering."""

    def __init__(self, served: Served, gate: Gate, prompts: Prompts):
        self.served, self.gate, self.prompts = served, gate, prompts
        self.words = TokenText(served.tokenizer)

    async def tokenize(self, request: Request) -> Response:
        self.gate.auth(request)
        served = self.served
        body = parse_json(await self.gate.body(request))
        ask = parse_tokenize(body)
        self.gate.model(model_of(body))
        if ask.form == "messages":
            chat = parse_chat(ask.chat, served.limits)
            self.prompts.check_tool_format(chat)
            prompts, _ = await run_in_threadpool(self.prompts.render, chat, ask.generation_prompt)
            ids = prompts[0]
        else:
            try:
                ids = await run_in_threadpool(
                    encode_prompt, served.tokenizer, ask.text, ask.specials
                )
            except UserError as e:  # the tokenizer failed on this text
                raise bad(str(e), ask.form) from None
        context = served.limits.context_length
        return JSONResponse(tokenize_body(ask, ids, self.words, context))

    async def detokenize(self, request: Request) -> Response:
        self.gate.auth(request)
        body = parse_json(await self.gate.body(request))
        ids = parse_detokenize(body, self.served.limits.vocab_size)
        self.gate.model(model_of(body))
        text = await run_in_threadpool(self.served.tokenizer.decode, ids)
        return JSONResponse(detokenize_body(text))

    async def apply_template(self, request: Request) -> Response:
        """llama.cpp's ``/apply-template``: ``{"messages", "tools"?, ...}`` as the chat
        template renders it for an answer, ``{"prompt": TEXT}``."""
        self.gate.auth(request)
        body = parse_json(await self.gate.body(request))
        for name in body:
            if name not in TEMPLATE_FIELDS:
                raise bad(f"{name} is not a field of /apply-template; send messages", name)
        chat = parse_chat(body, self.served.limits)
        self.gate.model(chat.model)
        self.prompts.check_tool_format(chat)
        _, text = await run_in_threadpool(self.prompts.render, chat)
        return JSONResponse({"prompt": text})

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: ``{"input_tokens": N}``."""
        self.gate.auth(request)
        body = parse_json(await self.gate.body(request))
        ask = parse_messages(body, self.served.limits, counting=True)
        self.gate.model(ask.model)
        self.prompts.check_tool_format(ask)
        prompts, _ = await run_in_threadpool(self.prompts.render, ask)
        return JSONResponse({"input_tokens": len(prompts[0])})
