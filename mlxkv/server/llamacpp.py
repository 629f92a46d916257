"""llama.cpp's own endpoints its clients use: ``/infill``, code completion at the cursor as
its editor plugins ask for it (llama.vim, llama.vscode), and ``/completion``, a prompt
continued, both in the shape of llama.cpp's own answers; ``/props``, the server's context
and template (``/apply-template``, a chat as the template renders it, is app.py's).

A request gives the text before the cursor's line (``input_prefix``), that line up to the
cursor (``prompt``), the text after the cursor (``input_suffix``) and chunks of other files
(``input_extra``); the model's fill-in-the-middle prompt is laid out from them as llama.cpp
lays it out (``mlxkv.models.fim.infill_ids``). The answer is one object (``content``,
``stop_type``, ``timings``, ...), or with ``stream`` a ``data:`` line per part and then the
last object; ``response_fields`` keeps only the fields a plugin reads, keyed by their paths
("timings/prompt_n").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from starlette.responses import JSONResponse

from mlxkv.engine.events import Stats
from mlxkv.models.fim import InfillText
from mlxkv.server.answers import Choice
from mlxkv.server.errors import TYPES, APIError, bad
from mlxkv.server.params import (
    LLAMA_SAMPLING,
    MAX_REPEAT_CONTEXT,
    Ask,
    Limits,
    bool_field,
    int_field,
    llama_cpp_hints,
    model_of,
    settings_of,
    show,
)

# llama.cpp's /completion options honoured here, under the names settings_of reads
SAMPLING = {
    **LLAMA_SAMPLING,
    "xtc_probability": "xtc_probability",
    "xtc_threshold": "xtc_threshold",
    "ignore_eos": "ignore_eos",
}
FIELDS = {
    *SAMPLING,
    "model",
    "prompt",
    "n_predict",
    "max_tokens",
    "n_cmpl",
    "stop",
    "repeat_last_n",
    "n_indent",
    "t_max_predict_ms",
    "stream",
    "response_fields",
    # accepted, without effect here: llama.cpp's sampler order (mlx-lm's is fixed), its
    # slots and their prompt reuse (the prefix cache serves every request), and its time
    # limit on the prompt (which llama.cpp's own plugins note it does not apply either)
    "samplers",
    "cache_prompt",
    "id_slot",
    "t_max_prompt_ms",
}
INFILL_FIELDS = {"input_prefix", "input_suffix", "input_extra"}
# samplers accepted only while off (their llama.cpp defaults)
OFF = {
    "n_probs": 0,
    "return_tokens": False,
    "typical_p": 1,
    "mirostat": 0,
    "dry_multiplier": 0,
    "dynatemp_range": 0,
    "top_n_sigma": -1,
}
LLAMA_RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's "any seed", as -1 is
MAX_FILES = 1024  # input_extra chunks


@dataclass
class Infill:
    """What /infill or /completion asked beyond an Ask: /infill's texts (None: a plain
    completion) and the answer's shape."""

    text: InfillText | None
    fields: list[str] | None  # response_fields (None: every field)
    truncated: bool = False  # a budget cut the prefix, the suffix or the files


def parse_infill(body: dict, limits: Limits, infill: bool = True) -> tuple[Ask, Infill]:
    """An /infill request, or (not ``infill``) a /completion one: its ``prompt`` (text or
    token ids) continued, as /v1/completions continues it."""
    path = "/infill" if infill else "/completion"
    known = FIELDS | INFILL_FIELDS if infill else FIELDS
    for name, value in body.items():
        if name in OFF:
            if value is not None and value != OFF[name]:
                raise bad(
                    f"{name} {show(value)} is not supported on {path}; send {OFF[name]} or "
                    "leave it out",
                    name,
                )
        elif name not in known:
            raise bad(f"{name} is not a field of {path} here; see docs/serve.md", name)
    text, prompts = None, []
    if infill:
        text = InfillText(
            _text(body, "input_prefix"),
            _text(body, "input_suffix"),
            _text(body, "prompt"),
            _files(body.get("input_extra")),
        )
    else:
        prompts = [_prompt(body.get("prompt"), limits)]
    given = {SAMPLING[k]: v for k, v in body.items() if k in SAMPLING}
    if given.get("seed") == LLAMA_RANDOM_SEED:
        given["seed"] = -1
    given["stop"] = body.get("stop")
    hint = "-1: until the model stops"
    n_predict = int_field(body, "n_predict", -2, 2**31 - 1, hint)
    if n_predict is None:
        n_predict = int_field(body, "max_tokens", -2, 2**31 - 1, hint)
    # unset: the server's --max-tokens, if any; -1 and -2: until the model stops
    unlimited = n_predict is not None and n_predict < 0
    limit = None if n_predict is None or unlimited else max(n_predict, 1)
    try:
        settings = settings_of(given, limits, limit, unlimited)
    except APIError as e:  # in llama.cpp's names
        if e.param == "repetition_penalty":
            e.param, e.message = "repeat_penalty", e.message.replace(e.param, "repeat_penalty")
        raise
    window = int_field(body, "repeat_last_n", -1, MAX_REPEAT_CONTEXT, "-1: the whole context")
    if window == 0:
        settings = replace(settings, repetition_penalty=None)
    elif window is not None:
        whole = limits.context_length or MAX_REPEAT_CONTEXT
        settings = replace(settings, repetition_context=window if window > 0 else whole)
    indent = int_field(body, "n_indent", 0, 2**31 - 1, "0: no limit")
    ms = int_field(body, "t_max_predict_ms", 0, 2**31 - 1, "0: no limit")
    settings = replace(
        settings,
        continues=True,  # the middle keeps the space its first token starts with
        min_indent=indent or 0,
        time_limit=ms / 1000 if ms else None,
    )
    stream = bool(bool_field(body, "stream"))
    hint = f"the server takes at most {limits.max_rows} answers in one request"
    n = int_field(body, "n_cmpl", 1, limits.max_rows, hint) or 1
    ask = Ask(
        kind="infill" if infill else "llama_completion",
        prompts=prompts,
        model=model_of(body),
        settings=settings,
        policy=None,
        logprobs=None,
        n=n,  # llama.vscode asks for 3 and shows the different ones
        stream=stream,
        warm_only=n_predict == 0,
    )
    llama_cpp_hints(body)
    int_field(body, "t_max_prompt_ms", -1, 2**31 - 1)
    return ask, Infill(text, body.get("response_fields") or None)  # [] is every field


def _text(body: dict, name: str) -> str:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad(f"{name} must be a string, got {show(v)}", name)
    return v or ""


def _prompt(v, limits: Limits) -> str | list[int]:
    """/completion's ``prompt``: a text or token ids of this model's vocabulary."""
    if isinstance(v, str) and v:
        return v
    top = limits.vocab_size or 2**31
    if isinstance(v, list) and v and all(type(t) is int and 0 <= t < top for t in v):
        return v
    raise bad(f"prompt must be a non-empty string or a list of token ids in [0, {top})", "prompt")


def _files(v) -> tuple[tuple[str, str], ...]:
    """``input_extra``: [{"filename", "text"}, ...] as (path, text) pairs."""
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > MAX_FILES:
        raise bad(
            f'input_extra must be a list of at most {MAX_FILES} {{"filename", "text"}} objects',
            "input_extra",
        )
    out = []
    for i, chunk in enumerate(v):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict):
            raise bad(f'{where} must be an object {{"filename", "text"}}', where)
        if extra := sorted(set(chunk) - {"filename", "text"}):
            raise bad(f"{where}.{extra[0]} is not a field of a chunk; send filename, text", where)
        path, body = chunk.get("filename", "tmp"), chunk.get("text", "")
        if not isinstance(path, str) or not isinstance(body, str):
            raise bad(f"{where}.filename and {where}.text must be strings", where)
        out.append((path, body))
    return tuple(out)


class Reply:
    """One /infill answer in llama.cpp's shape."""

    def __init__(self, model: str, infill: Infill, markers: tuple[str, ...]):
        self.model = model
        self.infill = infill
        self.markers = markers  # the format's own markers end the middle as EOS does
        self.id = f"infill-{time.perf_counter_ns()}"  # for the server's log line

    def chunk(self, text: str, index: int) -> dict:
        """A streamed part of answer ``index`` (the counts come with its last object)."""
        return {"index": index, "content": text, "tokens": [], "stop": False, "id_slot": 0}

    def last(self, c: Choice, text: str) -> dict:
        """The answer's last object: its whole text (``text``; "" after a stream) and
        figures."""
        s = c.stats or Stats()
        fresh = s.prompt_tokens - s.prompt_tokens_cached
        prompt_ms = _ms(fresh, s.prompt_tps)
        # the engine times the tokens after the first (which the prompt's pass gives)
        predicted_ms = _ms(max(s.generation_tokens - 1, 0), s.generation_tps)
        matched = c.stop if c.finish_reason == "stop_string" else None
        if c.finish_reason == "stop" or matched in self.markers:
            stop_type, word = "eos", ""
        elif matched is not None:
            stop_type, word = "word", matched
        else:
            stop_type, word = "limit", ""
        whole = "".join(c.text)
        out = {
            "index": c.index,
            "content": text,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": s.generation_tokens,
            "tokens_evaluated": s.prompt_tokens,
            "has_new_line": "\n" in whole,
            "truncated": self.infill.truncated,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": s.prompt_tokens + s.generation_tokens,
            "timings": {
                "cache_n": s.prompt_tokens_cached,
                "prompt_n": fresh,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / fresh if fresh else 0.0,
                "prompt_per_second": s.prompt_tps,
                "predicted_n": s.generation_tokens,
                "predicted_ms": predicted_ms,
                "predicted_per_token_ms": (
                    predicted_ms / s.generation_tokens if s.generation_tokens else 0.0
                ),
                "predicted_per_second": s.generation_tps,
            },
        }
        return pick(out, self.infill.fields)

    def whole(self, choices: list[Choice]) -> dict | list[dict]:
        """The answer (several: a list, as llama.cpp answers ``n_cmpl``)."""
        out = [self.last(c, "".join(c.text)) for c in choices]
        return out[0] if len(out) == 1 else out


def pick(obj: dict, fields: list[str] | None) -> dict:
    """llama.cpp's ``response_fields``: the values at these paths ("timings/prompt_n"),
    keyed by the paths; a path that leads nowhere is left out."""
    if fields is None:
        return obj
    out = {}
    for path in fields:
        value, found = obj, True
        for key in path.split("/"):
            if isinstance(value, dict) and key in value:
                value = value[key]
            else:
                found = False
                break
        if found:
            out[path] = value
    return out


def _ms(tokens: int, per_second: float) -> float:
    return tokens / per_second * 1000 if per_second else 0.0


def props_body(model: str, limits: Limits, tokenizer, slots: int, build: str) -> dict:
    """``GET /props``: what llama.cpp's clients read of a server (the context, ``n_ctx``,
    which llama.vscode sizes its prompts by), for the one model served."""
    s = limits.defaults
    return {
        "default_generation_settings": {
            "n_ctx": limits.context_length,
            "model": model,
            "params": {
                "n_predict": -1 if limits.open_ended else s.max_tokens,
                "temperature": s.temperature,
                "top_k": s.top_k,
                "top_p": s.top_p,
                "min_p": s.min_p,
            },
        },
        "total_slots": slots,  # answers decoded in one batch
        "model_alias": model,
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
        "bos_token": getattr(tokenizer, "bos_token", None) or "",
        "eos_token": getattr(tokenizer, "eos_token", None) or "",
        "modalities": {"vision": False, "audio": False},
        "build_info": build,
    }


def error_body(e: APIError) -> dict:
    """llama.cpp's error shape: ``{"error": {"code", "message", "type"}}``."""
    return {
        "error": {
            "code": e.status,
            "message": e.message,
            "type": TYPES.get(e.status, "invalid_request_error"),
        }
    }


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)
