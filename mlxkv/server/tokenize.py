"""``POST /tokenize`` and ``POST /detokenize`` as vLLM's and llama.cpp's servers answer them:
scripts count a prompt's tokens against the context (``max_model_len`` in ``/v1/models``)
before they send it, and read token ids back as text.

Three forms of ``/tokenize``, told apart by the field that holds the text: vLLM's
``prompt`` (a text completion's prompt) and ``messages`` (a chat, as
``/v1/chat/completions`` renders it) answer ``{count, max_model_len, tokens, token_strs}``;
llama.cpp's ``content`` answers ``{tokens}``. ``/detokenize`` takes ``{tokens}`` and answers
the text under both servers' names (vLLM's ``prompt``, llama.cpp's ``content``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxkv.server.errors import bad
from mlxkv.server.params import bool_field, show

CHAT_FIELDS = ("model", "messages", "tools", "chat_template_kwargs")
FLAGS = {  # each form's switches, and their defaults (vLLM's and llama.cpp's)
    "prompt": {"add_special_tokens": True, "return_token_strs": False},
    "messages": {"add_generation_prompt": True, "return_token_strs": False},
    "content": {"add_special": False, "parse_special": True, "with_pieces": False},
}


@dataclass(frozen=True)
class Tokenize:
    form: str  # "prompt", "messages" or "content": the field that holds the text
    text: str | None  # the prompt and content forms' text
    chat: dict | None  # the messages form: the chat-completion fields it renders as
    specials: bool  # the tokenizer's special tokens (BOS) added to the text
    generation_prompt: bool  # the messages form: the template opens the answer
    pieces: bool  # each token's text beside its id


def parse_tokenize(body: dict) -> Tokenize:
    forms = [f for f in FLAGS if f in body]
    if len(forms) != 1:
        raise bad(
            "send the text to tokenize as one of 'prompt' (a string), 'messages' (a chat) or "
            "'content' (a string)"
        )
    form = forms[0]
    allowed = {"model", form, *FLAGS[form], *(CHAT_FIELDS if form == "messages" else ())}
    for name in body:
        if name not in allowed:
            takes = ", ".join(sorted(allowed - {form}))
            raise bad(
                f"{name} does not go with '{form}' in /tokenize (it takes {takes})", param=name
            )
    flags = {}
    for name, default in FLAGS[form].items():
        value = bool_field(body, name)
        flags[name] = default if value is None else value
    if not flags.get("parse_special", True):
        raise bad("parse_special false is not supported: special tokens in the text are read")
    if form == "messages":
        chat = {k: body[k] for k in CHAT_FIELDS if body.get(k) is not None}
        generation = flags["add_generation_prompt"]
        return Tokenize(form, None, chat, False, generation, flags["return_token_strs"])
    text = body[form]
    if not isinstance(text, str):
        raise bad(f"{form} must be a string, got {show(text)}", param=form)
    if form == "prompt":
        pieces = flags["return_token_strs"]
        return Tokenize(form, text, None, flags["add_special_tokens"], False, pieces)
    return Tokenize(form, text, None, flags["add_special"], False, flags["with_pieces"])


def tokenize_body(ask: Tokenize, ids: list[int], words, context: int | None) -> dict:
    """The answer: vLLM's for its forms, llama.cpp's for ``content``; ``words`` (a
    TokenText) gives each token's bytes. A llama.cpp piece is the token's text, or its
    bytes where they are not whole UTF-8, as llama.cpp gives it."""
    if ask.form == "content":
        if not ask.pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": t, "piece": _piece(words.bytes(t))} for t in ids]}
    strs = words.tokenizer.convert_ids_to_tokens(ids) if ask.pieces else None
    return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}


def _piece(raw: bytes):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def parse_detokenize(body: dict, vocab_size: int | None) -> list[int]:
    for name in body:
        if name not in ("model", "tokens"):
            raise bad(f"Unrecognized request argument supplied: {name}", param=name)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise bad("tokens must be a list of token ids (integers)", param="tokens")
    top = vocab_size or 2**31
    if (wrong := next((t for t in ids if not 0 <= t < top), None)) is not None:
        raise bad(f"token id {wrong} is not in [0, {top})", param="tokens")
    return ids


def detokenize_body(text: str) -> dict:
    return {"prompt": text, "content": text}
