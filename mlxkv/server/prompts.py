"""How a request becomes the token ids the engine reads: the chat template applied (and a
Responses conversation cut to fit, ``truncation: "auto"``), a fill-in-the-middle prompt laid
out, a predicted output's and each embedding input's ids, each bounded before the tokenizer
reads it all. The methods that tokenize run in a worker thread."""

from __future__ import annotations

import functools
from dataclasses import replace

from mlxkv.engine.request import RESERVE_STEP, encode_text, most_prompt_characters
from mlxkv.errors import UserError
from mlxkv.models.fim import fim_format, has_tokens, infill_ids
from mlxkv.server import embeddings, llamacpp
from mlxkv.server.errors import APIError, bad
from mlxkv.server.params import Ask
from mlxkv.server.served import Served
from mlxkv.server.tools import has_tool_calling
from mlxkv.server.truncation import answer_room, fitted

# what a request can do instead, in each API's words (OpenAI's: chat and responses)
NO_TOOLS = {
    "openai": "leave 'tools' out, send tool_choice 'none', or force a call (tool_choice "
    "'required' or a function's name)",
    "messages": "leave 'tools' out, or send tool_choice {type: 'none'}, or force a call "
    "({type: 'any'} or {type: 'tool', name})",
    "api_chat": "leave 'tools' out",
}
TEXT_KINDS = ("completion", "infill", "llama_completion")  # prompts of text or ids, no template


class Prompts:
    """``served``'s prompts; ``encode(text)`` is the engine's tokenizer call."""

    def __init__(self, served: Served, encode):
        self.served = served
        self.encode = encode
        tok = served.tokenizer
        self.fim = fim_format(tok)  # read once: it walks the whole vocabulary
        self.repo_level = self.fim is not None and has_tokens(tok, self.fim.repo, self.fim.file_sep)

    def render(self, ask: Ask, answer: bool = True) -> tuple[list[list[int]], str]:
        """The prompts as token ids (the chat template applied), and a chat prompt's text
        (not ``answer``: the messages as the start of a longer prompt)."""

        def encode(text: str) -> list[int]:
            try:
                return self.encode(text)
            except UserError as e:  # the tokenizer failed on this text
                raise bad(str(e), "messages" if ask.messages else "prompt") from None

        if ask.kind in TEXT_KINDS:
            return [p if isinstance(p, list) else encode(p) for p in ask.prompts], ""
        tools = {"tools": ask.tools.tools} if ask.tools.on else {}
        # a last assistant message is the start of the answer: the template leaves it open
        go_on = ask.continue_final and answer
        ending = {"continue_final_message": True} if go_on else {}
        try:
            text = self.served.tokenizer.apply_chat_template(
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

    def truncated(self, ask: Ask) -> tuple[Ask, tuple[list[list[int]], str]]:
        """A Responses request without the oldest turns that keep its conversation from
        fitting the model's context with room for the answer (``truncation: "auto"``), and
        its render."""
        served = self.served
        context = served.limits.context_length
        if not context or (ask.policy or served.policy).window is not None:
            return ask, self.render(ask)  # a window takes a prompt of any length
        renders = {}  # by length: what is kept is the instructions and a suffix

        def count(messages: list[dict], whole: bool) -> int | None:
            if whole:
                renders[len(messages)] = self.render(replace(ask, messages=messages))
                return len(renders[len(messages)][0][0])
            try:
                return len(self.render(replace(ask, messages=messages), answer=False)[0][0])
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
        return ask, renders.get(len(kept)) or self.render(ask)

    def check_tool_format(self, ask: Ask) -> None:
        """Tools the model may call need its family's call format; a forced call does not
        (it is written as JSON held to the schema, whatever the family)."""
        served = self.served
        if ask.tools.on and not ask.tools.forced and not has_tool_calling(served.tokenizer):
            raise APIError(
                400,
                f"the model '{served.id}' cannot call tools: its chat template has no "
                f"tool-call format mlx-lm knows; {NO_TOOLS.get(ask.kind, NO_TOOLS['openai'])}",
                param="tools",
                code="tools_unsupported",
            )

    def fill_in(self, ask: Ask) -> Ask:
        """A completion with a suffix as the model's fill-in-the-middle prompts, which end
        where the model writes one of the format's markers."""
        if self.fim is None:
            raise APIError(
                400,
                f"suffix: the model '{self.served.id}' has no fill-in-the-middle tokens (as "
                "code models such as Qwen2.5-Coder, StarCoder2, DeepSeek-Coder and Codestral "
                "have); leave suffix out",
                param="suffix",
                code="fim_unsupported",
            )
        prompts = [self.fim.prompt(p, ask.suffix) for p in ask.prompts]
        return replace(ask, prompts=prompts, settings=self._ending_at_markers(ask.settings))

    def infill(self, ask: Ask, infill: llamacpp.Infill) -> Ask:
        """An /infill request's prompt, laid out as llama.cpp lays it out; its middle ends
        where the model writes one of the format's markers."""
        served = self.served
        if self.fim is None:
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
            served.tokenizer, self.fim, self.repo_level, infill.text, answer, limit
        )
        return replace(ask, prompts=[ids], settings=self._ending_at_markers(ask.settings))

    def _ending_at_markers(self, settings):
        """``settings`` whose answer (a middle) also ends at the FIM format's markers."""
        return replace(settings, stop=tuple(dict.fromkeys((*settings.stop, *self.fim.stops))))

    def prediction_ids(self, text: str) -> list[int]:
        """A predicted output's token ids (no markers added), refused past what the context
        could hold before the tokenizer reads it all."""
        most = self.most_characters
        if most is not None and len(text) > most:
            raise APIError(
                400,
                f"prediction has {len(text)} characters, more than an answer in a "
                f"{self.served.limits.context_length}-token context can hold; shorten it",
                "prediction",
                "context_length_exceeded",
            )
        try:
            return encode_text(self.served.tokenizer, text, False)
        except UserError as e:  # the tokenizer failed on this text
            raise bad(str(e), "prediction") from None

    def embedding_ids(self, ask: embeddings.EmbedAsk) -> list[list[int]]:
        """Each input's token ids as the model's tokenizer makes them for itself (with the
        markers it adds: an embedding model's end of text), each within the context (cut to
        it when the request says ``truncate``)."""
        out, context = [], self.served.limits.context_length
        most = self.most_characters

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
                ids = p if isinstance(p, list) else encode_text(self.served.tokenizer, p, True)
            except UserError as e:  # the tokenizer failed on this text
                raise bad(str(e), "input") from None
            if context and len(ids) >= context:
                if not ask.truncate:
                    raise too_long(i, f"{len(ids)} tokens")
                ids = ids[: context - 1]
            out.append(ids)
        return out

    @functools.cached_property
    def most_characters(self) -> int | None:
        """Characters no input can exceed and fit the context (read once: it walks the
        vocabulary)."""
        return most_prompt_characters(self.served.tokenizer, self.served.limits.context_length)
