"""Embeddings as OpenAI's ``/v1/embeddings`` and Ollama's ``/api/embed`` and
``/api/embeddings`` ask for them: each input's pooled final hidden state (the engine's
``Request.embed``), cut to ``dimensions`` and made unit length (OpenAI's and Ollama's
``/api/embed``; the older ``/api/embeddings`` answers it as pooled), as numbers or as
base64 (little-endian float32: what OpenAI's Python client asks for by default)."""

from __future__ import annotations

import base64
import math
import sys
from array import array
from dataclasses import dataclass

from mlxkv.server.errors import bad
from mlxkv.server.params import (
    Limits,
    bool_field,
    int_field,
    model_of,
    prompts_of,
    show,
    user_of,
)

MAX_INPUTS = 2048  # inputs per request, OpenAI's limit
OPENAI_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
OLLAMA_FIELDS = {"model", "input", "truncate", "dimensions", "options", "keep_alive"}
OLLAMA_OLD_FIELDS = {"model", "prompt", "options", "keep_alive"}


@dataclass
class EmbedAsk:
    """A checked embeddings request."""

    model: str | None
    inputs: list  # each a text or token ids
    as_base64: bool = False
    dimensions: int | None = None  # the vectors' first this many numbers (None: all)
    truncate: bool = False  # Ollama: an input past the context is cut to it, not refused
    normalize: bool = True


def _fields(body: dict, known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise bad(
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )


def parse_openai(body: dict, limits: Limits, width: int | None) -> EmbedAsk:
    """``/v1/embeddings``: ``input`` (a text, texts, token ids or lists of them),
    ``encoding_format``, ``dimensions``; ``width``: the model's hidden size."""
    _fields(body, OPENAI_FIELDS)
    if "input" not in body:
        raise bad("input is required: a text, a list of texts or of token ids", "input")
    inputs = prompts_of(body["input"], limits, "input", MAX_INPUTS)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        want = "encoding_format must be 'float' or 'base64'"
        raise bad(f"{want}, got {show(fmt)}", "encoding_format")
    dims = int_field(body, "dimensions", 1, width or 2**31, "at most the model's hidden size")
    user_of(body, "user")  # a string, else refused
    return EmbedAsk(model_of(body), inputs, fmt == "base64", dims)


def parse_ollama(body: dict, limits: Limits, width: int | None) -> EmbedAsk:
    """Ollama's ``/api/embed``: ``input`` (a text or texts), ``truncate`` (default true),
    ``dimensions``."""
    _fields(body, OLLAMA_FIELDS)
    v = body.get("input")
    if v is None or v == [] or v == "":
        raise bad("input is required: a text or a list of texts", "input")
    if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
        raise bad(f"input must be a text or a list of texts, got {show(v)}", "input")
    truncate = bool_field(body, "truncate") is not False
    dims = int_field(body, "dimensions", 1, width or 2**31, "at most the model's hidden size")
    if not isinstance(body.get("options") or {}, dict):
        raise bad(f"options must be an object, got {show(body['options'])}", "options")
    inputs = prompts_of(v, limits, "input", MAX_INPUTS)
    return EmbedAsk(model_of(body), inputs, dimensions=dims, truncate=truncate)


def parse_ollama_old(body: dict) -> EmbedAsk:
    """Ollama's older ``/api/embeddings``: one ``prompt``, answered as pooled."""
    _fields(body, OLLAMA_OLD_FIELDS)
    v = body.get("prompt")
    if not isinstance(v, str) or not v:
        raise bad(f"prompt must be a non-empty text, got {show(v)}", "prompt")
    return EmbedAsk(model_of(body), [v], normalize=False)


def finished(raw, ask: EmbedAsk) -> array:
    """A pooled vector as the answer gives it: its first ``dimensions`` numbers, made unit
    length (a vector of zeros stays zeros)."""
    v = array("f", raw[: ask.dimensions] if ask.dimensions else raw)
    if ask.normalize:
        norm = math.sqrt(math.fsum(x * x for x in v))
        if norm > 0:
            v = array("f", (x / norm for x in v))
    return v


def _base64(v: array) -> str:
    if sys.byteorder == "big":  # OpenAI's bytes are little-endian
        v = array("f", v)
        v.byteswap()
    return base64.b64encode(v.tobytes()).decode()


def openai_body(model: str, vectors: list[array], tokens: int, as_base64: bool) -> dict:
    data = [
        {"object": "embedding", "index": i, "embedding": _base64(v) if as_base64 else v.tolist()}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def ollama_body(model: str, vectors: list[array], tokens: int, seconds: float) -> dict:
    return {
        "model": model,
        "embeddings": [v.tolist() for v in vectors],
        "total_duration": int(seconds * 1e9),
        "load_duration": 0,
        "prompt_eval_count": tokens,
    }
