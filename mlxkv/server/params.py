"""The request bodies of /v1/chat/completions and /v1/completions, checked field by field.

Every parameter of the OpenAI API is either honoured or refused with a 400 naming it: a
parameter whose only accepted value is its no-op default (``store: false``,
``service_tier: "auto"``) is accepted with that value and refused with any
other. Names the API does not have are refused too.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace

from mlxkv.engine.request import GenerationSettings
from mlxkv.errors import UserError
from mlxkv.models.chat_template import RESERVED_ARGUMENTS
from mlxkv.policy import KVPolicy, PolicyError
from mlxkv.server.errors import bad
from mlxkv.server.tools import ToolUse, assistant_calls, check_tools, forced_schema

SEED_MAX = 2**64 - 1  # MLX seeds are unsigned 64-bit
# llama.cpp's "pick a seed at random", which OpenAI also takes; some clients always send it
SEED_RANDOM = -1
MAX_STOP = 64  # stop strings per request, every API: editors send dozens for code completion
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries: each costs a scatter per token
MAX_REPEAT_CONTEXT = 1 << 20  # tokens a repetition penalty may look back over
MAX_FIELDS = 64  # llama.cpp's samplers and response_fields
# llama.cpp's names of the sampling options (Ollama's options keep them) -> settings_of's
LLAMA_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
RETENTIONS = ("in_memory", "in-memory", "24h")  # "in-memory": the openai clients' first spelling

# A parameter accepted only with these values (JSON null always means "not given"); none
# given: refused whatever its value.
VERBOSITY = ("low", "medium", "high")
CHAT_NO_OPS = {
    "store": ((False,), "storing completions is not supported; leave 'store' out"),
    "metadata": (({},), "'metadata' goes with 'store', which is not supported; leave it out"),
    "functions": (([],), "'functions' is the retired form of 'tools'; send 'tools'"),
    "function_call": (
        ("none",),
        "'function_call' is the retired form of 'tool_choice'; send 'tool_choice'",
    ),
    "modalities": ((["text"],), 'only text output is supported (modalities ["text"])'),
    "audio": ((), "audio output is not supported"),
    # a hint to OpenAI's own models, as the Responses API's text.verbosity: the model here
    # answers at its own length
    "verbosity": (VERBOSITY, "verbosity must be one of low, medium, high"),
    "web_search_options": ((), "web search is not supported"),
    # "default" is what OpenAI's answers name the standard tier, which clients send back
    "service_tier": (("auto", "default"), "there is one service tier; send 'auto' or leave it out"),
}
COMPLETION_NO_OPS: dict = {}
_HONOURED = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    # extensions (as in mlx_lm.server, vLLM and llama.cpp's server)
    "kv",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context_size",
    "xtc_probability",
    "xtc_threshold",
    "min_tokens",
    "ignore_eos",
    # llama.cpp's server's own, which its clients (llama.vim) send
    "n_predict",
    "id_slot",
    "cache_prompt",
    "samplers",
    "response_fields",
}
CHAT_HONOURED = _HONOURED | {
    "messages",
    "prediction",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "safety_identifier",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "thinking_budget",  # extension (as Qwen's API): the most reasoning tokens
    "response_format",
    # prompt-caching hints agents send: the prefix cache matches requests by their tokens
    "prompt_cache_key",
    "prompt_cache_retention",
}
COMPLETION_HONOURED = _HONOURED | {"prompt", "logprobs", "best_of", "echo", "suffix"}

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# per-request KV policy: the CLI flags' names without "--kv-"
KV_FIELDS = (
    "window",
    "sinks",
    "bits",
    "group_size",
    "max_kv_size",
    "key_bits",
    "value_bits",
    "value_group_size",
)
_FLAG_NAMES = {
    "--kv-value-group-size": "kv.value_group_size",
    "--kv-group-size": "kv.group_size",
    "--kv-key-bits": "kv.key_bits",
    "--kv-value-bits": "kv.value_bits",
    "--kv-window": "kv.window",
    "--kv-sinks": "kv.sinks",
    "--kv-bits": "kv.bits",
    "--max-kv-size": "kv.max_kv_size",
}


@dataclass
class Limits:
    """What the server allows a request (from its command line)."""

    max_rows: int = 16  # choices one request may ask for (prompts x n)
    vocab_size: int | None = None  # token-id prompts must be below it
    context_length: int | None = None  # the model's trained context
    defaults: GenerationSettings = field(default_factory=GenerationSettings)
    # a request that sets no limit runs until the model stops or its context is full (the
    # server was started without --max-tokens); else defaults.max_tokens is its limit
    open_ended: bool = False


@dataclass
class Ask:
    """A checked request: what to render and run, and how to answer."""

    kind: str  # "chat" | "completion" | "messages"
    model: str | None
    settings: GenerationSettings
    policy: KVPolicy | None  # None: the server's default policy
    logprobs: int | None  # None: off; k: the chosen token's logprob and k alternatives
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    messages: list[dict] = field(default_factory=list)
    template_kwargs: dict = field(default_factory=dict)
    prompts: list = field(default_factory=list)  # completions: text or token ids, each
    user: str | None = None
    tools: ToolUse = field(default_factory=ToolUse)  # chat: the tools offered
    continue_final: bool = False  # the last message is the answer's start, to go on from
    warm_only: bool = False  # max_tokens 0: the prompt alone (cached, or scored with echo)
    echo: bool = False  # completions: the prompt comes back before the answer
    prompt_logprobs: int | None = None  # completions with echo: the prompt's tokens scored
    show_thinking: bool = True  # messages: thinking blocks carry their text
    suffix: str | None = None  # completions: the text after the answer (fill-in-the-middle)
    prediction: str | None = None  # chat: the answer's expected text (drafts come from it)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, every string in it valid Unicode."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise bad("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    _check_strings(body, "")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_strings(value, path: str) -> None:
    """Refuse a string that cannot be UTF-8 (a lone surrogate such as "\\ud800")."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(
                    f"{p or 'the body'} is not valid Unicode text (a lone surrogate at "
                    f"character {e.start}); send UTF-8 text",
                    param=p or None,
                ) from None
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    continue
                stack.append((k, p or "the body"))
                stack.append((x, f"{p}.{k}" if p else k))
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))


# -- field checks ----------------------------------------------------------------------------
def _given(body: dict, name: str) -> bool:
    return body.get(name) is not None


def int_field(body: dict, name: str, lo: int, hi: int, hint: str = "") -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name} must be an integer, got {show(v)}", param=name)
    if not lo <= v <= hi:
        raise bad(f"{name} must be in [{lo}, {hi}], got {v}" + (f"; {hint}" if hint else ""), name)
    return v


def number_field(
    body: dict, name: str, lo: float, hi: float | None, lo_open: bool = False, hint: str = ""
) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"{name} must be a number, got {show(v)}", param=name)
    v = float(v)
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        want = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi is not None else None
        want = f"in {want}" if want else f"{'above' if lo_open else 'at least'} {lo:g}"
        raise bad(f"{name} must be {want}, got {v:g}" + (f"; {hint}" if hint else ""), name)
    return v


def bool_field(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {show(v)}", param=name)
    return v


def show(v) -> str:
    text = json.dumps(v, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_names(body: dict, honoured: set[str], no_ops: dict) -> None:
    for name, value in body.items():
        if name in honoured:
            continue
        if name not in no_ops:
            raise bad(
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )
        if value is None:
            continue
        accepted, why = no_ops[name]
        if value not in accepted:
            raise bad(f"{name}: {why}", param=name, code="unsupported_parameter")


def _stop(body: dict) -> tuple[str, ...] | None:
    v = body.get("stop")
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP:
        raise bad(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise bad("stop strings must not be empty", param="stop")
    return tuple(stops)


def policy_of(body: dict) -> KVPolicy | None:
    kv = body.get("kv")
    if kv is None:
        return None
    if not isinstance(kv, dict):
        raise bad(
            'kv must be an object such as {"window": 1020, "sinks": 4, "bits": 4}', param="kv"
        )
    flags = {}
    for name, value in kv.items():
        if name not in KV_FIELDS:
            raise bad(
                f"kv.{name} is not a KV policy field; use {', '.join(KV_FIELDS)}",
                param=f"kv.{name}",
            )
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad(f"kv.{name} must be an integer, got {show(value)}", param=f"kv.{name}")
        flags[name] = value
    try:
        return KVPolicy.from_flags(**flags)
    except PolicyError as e:
        raise bad(api_names(str(e)), param="kv", code="invalid_policy") from None


def api_names(message: str) -> str:
    """A policy error worded for the API: ``--kv-window`` becomes ``kv.window``."""
    return re.sub(
        "|".join(re.escape(f) for f in _FLAG_NAMES), lambda m: _FLAG_NAMES[m.group(0)], message
    )


def settings_of(
    body: dict, limits: Limits, max_tokens: int | None, unlimited: bool = False
) -> GenerationSettings:
    """The sampling and limits of ``body``; ``max_tokens`` None: the request set no limit,
    so the answer is open-ended where the server (or, ``unlimited``, the request) says so."""
    given = {
        "max_tokens": max_tokens,
        "temperature": number_field(body, "temperature", 0, 2, hint="0 means greedy"),
        "top_p": number_field(body, "top_p", 0, 1, lo_open=True),
        "top_k": int_field(body, "top_k", 0, 2**31 - 1, "0 keeps every token"),
        "min_p": number_field(body, "min_p", 0, 1),
        "repetition_penalty": number_field(body, "repetition_penalty", 0, None, lo_open=True),
        "repetition_context": int_field(body, "repetition_context_size", 1, MAX_REPEAT_CONTEXT),
        "xtc_probability": number_field(body, "xtc_probability", 0, 1, hint="0 means none"),
        "xtc_threshold": number_field(body, "xtc_threshold", 0, 0.5),
        "min_tokens": int_field(body, "min_tokens", 0, 2**31 - 1),
        "ignore_eos": bool_field(body, "ignore_eos"),
        "presence_penalty": number_field(body, "presence_penalty", -2, 2, hint="0 means none"),
        "frequency_penalty": number_field(body, "frequency_penalty", -2, 2, hint="0 means none"),
        "logit_bias": _logit_bias(body, limits.vocab_size),
        "seed": _seed(body),
        "stop": _stop(body),
    }
    if max_tokens is not None and (given["min_tokens"] or 0) > max_tokens:
        raise bad(
            f"min_tokens ({given['min_tokens']}) is more than max_tokens ({max_tokens}); "
            "lower min_tokens or raise max_tokens",
            param="min_tokens",
        )
    if max_tokens is None and (unlimited or limits.open_ended):
        given |= {"max_tokens": limits.context_length or 2**31 - 1, "open_ended": True}
    try:
        return replace(limits.defaults, **{k: v for k, v in given.items() if v is not None})
    except UserError as e:  # GenerationSettings' own checks (the ranges above cover them)
        raise bad(str(e)) from None


def _seed(body: dict) -> int | None:
    if type(body.get("seed")) is int and body["seed"] == SEED_RANDOM:
        return None
    return int_field(body, "seed", 0, SEED_MAX, f"{SEED_RANDOM} means a random seed")


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` ({"token id": bias in [-100, 100]}) as (id, bias) pairs."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad('logit_bias must be an object such as {"1234": -100}', param="logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad(f"logit_bias holds {len(v)} tokens; at most {MAX_LOGIT_BIAS}", "logit_bias")
    top = vocab_size if vocab_size is not None else 2**31
    pairs = []
    for key, bias in v.items():
        # (a thousand-digit key is no token id, and too long for int() to read)
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < top):
            raise bad(
                f"logit_bias key {show(key)} is not a token id of this model; keys are token "
                f"ids in [0, {top}) written as strings",
                param="logit_bias",
            )
        number = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not (number and -100 <= bias <= 100):
            raise bad(
                f'logit_bias["{key}"] must be a number in [-100, 100], got {show(bias)}',
                param="logit_bias",
            )
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = bool(bool_field(body, "stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", param="stream_options")
    for k, v in opts.items():
        if k == "include_usage":
            continue
        if k == "include_obfuscation" and v in (None, False):
            continue
        raise bad(f"stream_options.{k} is not supported", param=f"stream_options.{k}")
    return stream, bool(bool_field(opts, "include_usage"))


def model_of(body: dict) -> str | None:
    v = body.get("model")
    if v is not None and not isinstance(v, str):
        raise bad(f"model must be a string, got {show(v)}", param="model")
    return v


def user_of(body: dict, *names: str) -> str | None:
    """Who the request is for (the first of ``names`` given), for the server's log."""
    for name in names:
        v = body.get(name)
        if v is not None and not isinstance(v, str):
            raise bad(f"{name} must be a string", param=name)
    return next((body[n] for n in names if body.get(n)), None)


def cache_hints(body: dict) -> None:
    """``prompt_cache_key`` and ``prompt_cache_retention``, checked: the prefix cache keeps
    every request's prefix whatever they say, in memory and then on disk (the server's
    --prefix-cache-* flags bound it)."""
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise bad(f"prompt_cache_key must be a string, got {show(key)}", "prompt_cache_key")
    keep = body.get("prompt_cache_retention")
    if keep is not None and keep not in RETENTIONS:
        raise bad(
            f"prompt_cache_retention must be 'in_memory' or '24h', got {show(keep)}",
            param="prompt_cache_retention",
        )


def llama_cpp_hints(body: dict) -> None:
    """llama.cpp's fields its clients send with every request, checked: the slot to run in
    and whether to reuse its cache (the prefix cache serves every request), the samplers'
    order (mlx-lm's is fixed), and the fields to answer with (an OpenAI answer keeps them
    all, as llama.cpp's own does)."""
    int_field(body, "id_slot", -1, 2**31 - 1, "-1: any")
    bool_field(body, "cache_prompt")
    for name in ("samplers", "response_fields"):
        v = body.get(name)
        strings = isinstance(v, list) and all(isinstance(x, str) for x in v)
        if v is not None and not (strings and len(v) <= MAX_FIELDS):
            if not (name == "samplers" and isinstance(v, str)):  # llama.cpp's letters form
                raise bad(f"{name} must be a list of at most {MAX_FIELDS} strings", name)


def n_predict_of(body: dict, *limits: tuple[str, int | None]) -> int | None:
    """llama.cpp's ``n_predict`` (-1: no limit, None) beside the API's own ``limits``
    (name, value): those given must agree."""
    n = int_field(body, "n_predict", -1, 2**31 - 1, "-1: until the model stops")
    given = [(k, v) for k, v in (*limits, ("n_predict", None if n == -1 else n)) if v is not None]
    for name, v in given[1:]:
        if v != given[0][1]:
            raise bad(f"{given[0][0]} ({given[0][1]}) and {name} ({v}) disagree; send one", name)
    return given[0][1] if given else None


def _n(body: dict, prompts: int, limits: Limits) -> int:
    hint = f"the server takes at most {limits.max_rows} answers in one request"
    n = int_field(body, "n", 1, limits.max_rows, hint) or 1
    if prompts * n > limits.max_rows:
        raise bad(
            f"this request asks for {prompts * n} answers ({prompts} prompts x n={n}); the "
            f"server takes at most {limits.max_rows} in one request",
            param="n",
        )
    return n


# -- the two endpoints -------------------------------------------------------------------------
def parse_chat(body: dict, limits: Limits) -> Ask:
    _check_names(body, CHAT_HONOURED, CHAT_NO_OPS)
    if "messages" not in body:
        raise bad("messages is required: a list of {role, content} objects", param="messages")
    messages = _messages(body["messages"])
    tools = check_tools(body)
    kwargs = {**_effort(body), **template_kwargs_of(body.get("chat_template_kwargs"))}
    llama_cpp_hints(body)
    most = n_predict_of(
        body,
        ("max_tokens", int_field(body, "max_tokens", 1, 2**31 - 1)),
        ("max_completion_tokens", int_field(body, "max_completion_tokens", 1, 2**31 - 1)),
    )
    logprobs = bool_field(body, "logprobs")
    top = int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs needs logprobs: true", param="top_logprobs")
    stream, usage = _stream(body)
    cache_hints(body)
    # n_predict 0 (llama.vim's warm-up): the conversation is prefilled and kept, no answer
    settings = settings_of(body, limits, 1 if most == 0 else most)
    grammar = answer_grammar(tools, _response_format(body.get("response_format")))
    # (the server's --min-tokens and --ignore-eos yield to a schema: it ends the answer)
    if grammar is not None and (body.get("min_tokens") or body.get("ignore_eos")):
        name = "min_tokens" if body.get("min_tokens") else "ignore_eos"
        raise bad(
            f"{name} cannot go with response_format or a forced tool call: that answer ends "
            f"where its schema does; leave {name} out",
            param=name,
        )
    budget = int_field(body, "thinking_budget", 0, 2**31 - 1, "0 closes the thinking at once")
    return Ask(
        kind="chat",
        model=model_of(body),
        settings=replace(
            settings,
            grammar=grammar,
            think_budget=settings.think_budget if budget is None else budget,
        ),
        policy=policy_of(body),
        logprobs=(top or 0) if logprobs else None,
        n=_n(body, 1, limits),
        stream=stream,
        include_usage=usage,
        messages=messages,
        template_kwargs=kwargs,
        user=user_of(body, "user", "safety_identifier"),
        tools=tools,
        warm_only=most == 0,
        prediction=_prediction(body.get("prediction")),
    )


def _prediction(v) -> str | None:
    """OpenAI's predicted output: ``{"type": "content", "content": TEXT}``, the content a
    string or a list of text parts (joined)."""
    if v is None:
        return None
    shape = 'prediction must be {"type": "content", "content": "the expected answer"}'
    if not isinstance(v, dict) or v.get("type") != "content" or set(v) - {"type", "content"}:
        raise bad(shape, param="prediction")
    content = v.get("content")
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(
            "prediction.content must be a string or a list of text parts", "prediction.content"
        )
    return content


def parse_completion(body: dict, limits: Limits) -> Ask:
    _check_names(body, COMPLETION_HONOURED, COMPLETION_NO_OPS)
    if "prompt" not in body:
        raise bad("prompt is required: a string, a list of strings or token ids", param="prompt")
    # fill in the middle at a file's start: an empty prompt before a suffix
    at_start = isinstance(body.get("suffix"), str) and body["suffix"] != ""
    prompts = prompts_of(body["prompt"], limits, empty_ok=at_start)
    n = _n(body, len(prompts), limits)
    best_of = int_field(body, "best_of", 1, limits.max_rows)
    if best_of is not None and best_of != n:
        raise bad(
            f"best_of {best_of} (ranking several answers) is not supported; send best_of = n",
            param="best_of",
        )
    stream, usage = _stream(body)
    echo = bool(bool_field(body, "echo"))
    if echo and stream:
        raise bad("echo is not supported with stream: true; ask for the whole answer", "echo")
    suffix = _suffix(body.get("suffix"), prompts, echo)
    # with echo, max_tokens 0 scores the prompt alone (one token is decoded and not sent);
    # llama.cpp's n_predict 0 prefills it alone
    llama_cpp_hints(body)
    max_tokens = n_predict_of(
        body, ("max_tokens", int_field(body, "max_tokens", 0 if echo else 1, 2**31 - 1))
    )
    logprobs = int_field(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    return Ask(
        kind="completion",
        model=model_of(body),
        settings=replace(
            settings_of(body, limits, 1 if max_tokens == 0 else max_tokens), continues=True
        ),
        policy=policy_of(body),
        logprobs=logprobs,
        n=n,
        stream=stream,
        include_usage=usage,
        prompts=prompts,
        user=user_of(body, "user"),
        echo=echo,
        prompt_logprobs=logprobs if echo else None,
        warm_only=max_tokens == 0,
        suffix=suffix,
    )


def _suffix(v, prompts: list, echo: bool) -> str | None:
    """``suffix``: the text after the insertion; the answer fills the middle."""
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise bad(f"suffix must be a string, got {show(v)}", param="suffix")
    if echo:
        raise bad("suffix and echo cannot go together; send one", param="suffix")
    if not all(isinstance(p, str) for p in prompts):
        raise bad("suffix needs the prompt as text, not token ids", param="suffix")
    return v


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(v)]


def _message(m, where: str) -> dict:
    """One message as the chat template reads it."""
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object with role and content", param=where)
    role = m.get("role")
    if role == "function":
        raise bad(
            f"{where}: role 'function' is the retired form of role 'tool'; send the result "
            "as {role: 'tool', tool_call_id, content}",
            param=f"{where}.role",
        )
    if not isinstance(role, str) or (role not in ROLES and role != "tool"):
        raise bad(
            f"{where}.role must be one of {', '.join(ROLES)}, tool, got {show(role)}",
            param=f"{where}.role",
        )
    allowed = {"role", "content", "name"}
    if role == "tool":
        allowed.add("tool_call_id")
    if role == "assistant":  # the reasoning this server (or DeepSeek's, vLLM's) sent back
        allowed |= {"tool_calls", "reasoning_content", "reasoning"}
    for k, x in m.items():
        if k in allowed or (k in ("refusal", "function_call", "tool_calls") and not x):
            continue
        raise bad(f"{where}.{k} is not supported; send role and content", f"{where}.{k}")
    calls = m.get("tool_calls")
    out = {"role": ROLES.get(role, role)}
    name = m.get("name")
    if name is not None:  # a participant's name: handed to the chat template, as OpenAI's
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
        out["name"] = name
    if role == "assistant":
        for k in ("reasoning_content", "reasoning"):
            if m.get(k) is not None and not isinstance(m[k], str):
                raise bad(f"{where}.{k} must be a string", f"{where}.{k}")
        # the template shows it where the model reads its own earlier thinking (Qwen3's does)
        if thought := m.get("reasoning_content") or m.get("reasoning"):
            out["reasoning_content"] = thought
    if role == "assistant" and calls:
        # an assistant turn that called tools may have no text
        c = m.get("content")
        out["content"] = "" if c is None else _content(c, where)
        out["tool_calls"] = assistant_calls(calls, where)
        return out
    out["content"] = _content(m.get("content"), where)
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad(
                f"{where}.tool_call_id must be the id of the call this message answers",
                f"{where}.tool_call_id",
            )
        out["tool_call_id"] = call_id
    return out


def _content(c, where: str) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c:
        parts = []
        for j, p in enumerate(c):
            ok = isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            if not ok:
                kind = p.get("type") if isinstance(p, dict) else None
                raise bad(
                    f"{where}.content[{j}]: only text parts are supported"
                    + (f" (got '{kind}')" if isinstance(kind, str) else ""),
                    param=f"{where}.content",
                )
            parts.append(p["text"])
        return "\n".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _response_format(v) -> str | None:
    """``response_format`` as the grammar the answer is held to: {"type": "text"} none,
    {"type": "json_object"} any JSON object, {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}} JSON text matching the schema."""
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad(
            "response_format.type must be 'text', 'json_object' or 'json_schema', got "
            f"{show(kind if kind is not None else v)}",
            param="response_format",
        )
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    for k in v:
        if k not in allowed:
            raise bad(f"response_format.{k} is not a field of a {kind} format", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar(None, "response_format")
    spec = v.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad(f"{where} must be an object {{name, schema}}", where)
    for k in spec:
        if k not in ("name", "schema", "strict", "description"):
            raise bad(f"{where}.{k} is not a field; use name, schema, strict, description", where)
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise bad(f"{where}.name must be 1 to 64 letters, digits, '_' or '-'", f"{where}.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad(f"{where}.strict must be true or false", f"{where}.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad(f"{where}.schema must be a JSON Schema object", f"{where}.schema")
    return schema_grammar(schema, f"{where}.schema")


def answer_grammar(tools: ToolUse, grammar: str | None) -> str | None:
    """What holds the answer: a forced tool call's schema, else the answer format's grammar.
    A forced call wins: the format is that of a text answer, and there is none (instructor
    sends both, the format naming the same schema)."""
    if not tools.forced:
        return grammar
    return schema_grammar(forced_schema(tools), "tools")


def schema_grammar(schema: dict | None, param: str) -> str:
    """The grammar of a JSON schema (None: any JSON object); a schema the grammar engine
    cannot compile is a 400 naming ``param``."""
    from mlxkv.engine.grammar import json_grammar

    try:
        return json_grammar(schema)
    except UserError as e:
        raise bad(str(e), param=param, code="invalid_schema") from None


def _effort(body: dict) -> dict:
    """``reasoning_effort`` as chat template arguments: the effort itself (gpt-oss's
    templates read ``reasoning_effort``) and, for "none", ``enable_thinking: false``
    (Qwen3's and others' switch). A template that reads neither ignores them, as a model
    that does not think does; chat_template_kwargs given beside it win."""
    v = body.get("reasoning_effort")
    if v is None:
        return {}
    if v not in EFFORTS:
        raise bad(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {show(v)}",
            param="reasoning_effort",
        )
    return {"reasoning_effort": v, **({"enable_thinking": False} if v == "none" else {})}


def template_kwargs_of(v) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("chat_template_kwargs must be an object", param="chat_template_kwargs")
    for k in v:
        if k in RESERVED_ARGUMENTS:
            raise bad(
                f"chat_template_kwargs.{k} is set by the server and cannot be passed",
                param=f"chat_template_kwargs.{k}",
            )
    return dict(v)


def prompts_of(
    v, limits: Limits, name: str = "prompt", most: int | None = None, empty_ok: bool = False
) -> list:
    """Completions' prompt (or embeddings' input, ``name``): a string, a list of strings,
    token ids, or lists of token ids; at most ``most`` of them (None: ``limits.max_rows``;
    ``empty_ok``: an empty string is a prompt too)."""
    if isinstance(v, str):
        items = [v]
    elif (
        isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    ):
        items = [v]
    elif isinstance(v, list) and v:
        items = v
    else:
        raise bad(f"{name} must be a non-empty string, list of strings or token ids", name)
    most = limits.max_rows if most is None else most
    if len(items) > most:
        raise bad(f"{name} holds {len(items)} {name}s; at most {most}", name)
    for i, p in enumerate(items):
        where = f"{name}[{i}]" if len(items) > 1 or not isinstance(v, str) else name
        if isinstance(p, str):
            if not p and not empty_ok:
                raise bad(f"{where} is empty", param=name)
            continue
        ids = isinstance(p, list) and p
        if not ids or not all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            raise bad(f"{where} must be a non-empty string or list of token ids", name)
        top = limits.vocab_size
        bad_id = next((x for x in p if x < 0 or (top is not None and x >= top)), None)
        if bad_id is not None:
            raise bad(
                f"{where} holds token id {bad_id}, outside the vocabulary [0, {top})",
                param=name,
            )
    return items
