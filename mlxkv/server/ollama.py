"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``), the one Open WebUI, editor plugins and many scripts speak to a local
model server: a request is checked and turned into the same ``Ask`` as a chat or text
completion, and the answer into Ollama's objects, whole or streamed as lines of JSON.

As on the other endpoints, every field is either honoured or refused with a 400 that
names it; the options that place a model on hardware (``num_gpu``, ``num_thread``, ...)
are accepted and have no effect, since MLX places the model itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone

from starlette.responses import JSONResponse

from mlxkv.engine.events import Stats
from mlxkv.policy import KVPolicy, PolicyError
from mlxkv.server.answers import FINISH_REASONS, Choice, Part, kv_figures, without_bytes
from mlxkv.server.errors import APIError, bad
from mlxkv.server.params import (
    LLAMA_SAMPLING,
    MAX_REPEAT_CONTEXT,
    MAX_STOP,
    MAX_TOP_LOGPROBS,
    Ask,
    Limits,
    bool_field,
    int_field,
    schema_grammar,
    settings_of,
    show,
)
from mlxkv.server.tools import ToolUse, assistant_calls, function_of, tool_list

STREAM_MEDIA = "application/x-ndjson"
# The Ollama release whose API this one matches (logprobs came in 0.12.11): clients check
# /api/version before they use a server (VS Code's Copilot wants 0.6.4 or later).
API_VERSION = "0.12.11"
THINK_LEVELS = ("low", "medium", "high")

COMMON = {"model", "format", "options", "stream", "keep_alive", "think", "logprobs", "top_logprobs"}
CHAT_FIELDS = COMMON | {"messages", "tools"}
GENERATE_FIELDS = COMMON | {"prompt", "system", "raw", "suffix", "template", "context", "images"}
# what a served text model cannot take, and the retired way of passing a conversation
GENERATE_REFUSED = {
    "template": "a request's own template is not supported: the model's chat template is "
    "used, or send raw: true with the prompt as the model reads it",
    "context": "context (the token list of an earlier answer) is not supported; send the "
    "conversation to /api/chat",
    "images": "images are not supported: the served model reads text",
}
# options -> the names settings_of reads
SAMPLING = {**LLAMA_SAMPLING, "stop": "stop"}
# where the model runs and how it is read from disk: MLX decides all of it
RUNTIME = {
    "numa",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "embedding_only",
    "num_thread",
    "penalize_newline",  # retired by Ollama itself, which ignores it too
}
# samplers that only their "off" value is accepted for
OFF = {"mirostat": 0, "tfs_z": 1, "typical_p": 1}
MIROSTAT_KNOBS = ("mirostat_eta", "mirostat_tau")  # no effect while mirostat is off


def error_response(e: APIError) -> JSONResponse:
    """Ollama's error shape: ``{"error": "message"}``."""
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# -- requests -----------------------------------------------------------------------------
def parse_chat(body: dict, limits: Limits) -> Ask:
    _check_names(body, CHAT_FIELDS)
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    return _ask(body, limits, "api_chat", messages=messages, tools=tools)


def parse_generate(body: dict, limits: Limits) -> Ask:
    _check_names(body, GENERATE_FIELDS)
    for name, why in GENERATE_REFUSED.items():
        if body.get(name) not in (None, "", []):
            raise bad(f"{name}: {why}", name)
    prompt, system = body.get("prompt") or "", body.get("system") or ""
    for name, v in (("prompt", prompt), ("system", system)):
        if not isinstance(v, str):
            raise bad(f"{name} must be a string, got {show(v)}", name)
    suffix = body.get("suffix") or None
    if suffix is not None:  # fill in the middle: the model's own format, not its template
        if not isinstance(suffix, str):
            raise bad(f"suffix must be a string, got {show(suffix)}", "suffix")
        if system:
            raise bad("system cannot go with suffix (a completion between two texts)", "system")
        return replace(_ask(body, limits, "api_generate", prompts=[prompt]), suffix=suffix)
    if bool_field(body, "raw"):
        if system:
            raise bad(
                "system goes through the chat template; with raw: true leave it out", "system"
            )
        return _ask(body, limits, "api_generate", prompts=[prompt] if prompt else [])
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": prompt}] if prompt else []
    return _ask(body, limits, "api_generate", messages=messages)


def _check_names(body: dict, fields: set[str]) -> None:
    for name in body:
        if name not in fields:
            raise bad(f"{name} is not a field of this request; see Ollama's API", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required", "model")


def _ask(body: dict, limits: Limits, kind: str, messages=(), prompts=(), tools=None) -> Ask:
    settings, policy = _options(body.get("options"), limits)
    grammar = _format(body.get("format"))
    logprobs = bool_field(body, "logprobs")
    top = int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    stream = bool_field(body, "stream")
    _keep_alive(body.get("keep_alive"), loading=not (messages or prompts))
    raw = bool(prompts)
    return Ask(
        kind="completion" if raw else kind,
        model=body["model"],
        settings=replace(settings, grammar=grammar, continues=raw),
        policy=policy,
        logprobs=(top or 0) if logprobs else None,
        stream=stream is not False,  # Ollama streams unless told not to
        messages=list(messages),
        prompts=list(prompts),
        template_kwargs=_think(body.get("think")),
        tools=tools or ToolUse(),
    )


def _keep_alive(v, loading: bool) -> None:
    """``keep_alive`` is accepted: the model stays loaded while the server runs. A request
    that asks to unload it (0 with nothing to answer) is refused: it would free nothing."""
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise bad(f'keep_alive must be a duration such as "5m" or seconds, got {show(v)}')
    if loading and v in (0, "0", "0s", "0m"):
        raise bad(
            "keep_alive 0 asks to unload the model; this server keeps the one model it "
            "started with loaded: stop mlxkv serve to free its memory",
            "keep_alive",
        )


def _options(v, limits: Limits) -> tuple:
    """``options``: the sampling settings, ``num_predict`` as the token limit, and
    ``num_ctx`` (with ``num_keep``) as the KV policy: a context shorter than the model's
    runs under sinks + a window of that many tokens in all, which is what Ollama's
    context shift keeps (its first ``num_keep`` tokens, default 4, and the latest)."""
    v = {} if v is None else v
    if not isinstance(v, dict):
        raise bad('options must be an object such as {"temperature": 0}', "options")
    given = {}
    for name, x in v.items():
        where = f"options.{name}"
        if x is None or name in RUNTIME:
            continue
        if name == "seed" and type(x) is int and x < 0:  # Ollama's "random", its default
            continue
        if name in SAMPLING:
            given[SAMPLING[name]] = x
        elif name in OFF:
            if isinstance(x, bool) or x != OFF[name]:
                raise bad(f"{where}: this sampler is not supported; send {OFF[name]} (off)", where)
        elif name in MIROSTAT_KNOBS:
            if isinstance(x, bool) or not isinstance(x, int | float):
                raise bad(f"{where} must be a number, got {show(x)}", where)
        elif name not in ("num_predict", "num_ctx", "num_keep", "repeat_last_n"):
            raise bad(f"{where} is not an option of this server; see docs/serve.md", where)
    stops = _stops(given.pop("stop", None))
    predict = int_field(v, "num_predict", -2, 2**31 - 1, "-1: until the model stops")
    if predict == 0:
        raise bad("options.num_predict 0 generates nothing; send at least 1, or -1", "options")
    # -1 (no limit) and -2 (fill the context): until the model stops or its context is full
    unlimited = predict is not None and predict < 0
    try:
        settings = settings_of(given, limits, None if unlimited else predict, unlimited)
        hint = "0 turns the penalty off, -1 looks over the whole context"
        window = int_field(v, "repeat_last_n", -1, MAX_REPEAT_CONTEXT, hint)
    except APIError as e:
        raise bad(f"options.{e.message}", f"options.{e.param}" if e.param else "options") from None
    if stops:
        settings = replace(settings, stop=stops)
    # repeat_last_n: the tokens repeat_penalty looks back over (0: none, -1: the context)
    if window == 0:
        settings = replace(settings, repetition_penalty=None)
    elif window is not None and window < 0:
        ctx = v.get("num_ctx")
        ctx = ctx if type(ctx) is int and ctx > 0 else limits.context_length
        settings = replace(settings, repetition_context=ctx or MAX_REPEAT_CONTEXT)
    elif window is not None:
        settings = replace(settings, repetition_context=window)
    return settings, _context(v, limits)


def _stops(v) -> tuple[str, ...]:
    """``options.stop``: Ollama sets no count (editors send a score for code completion);
    a bound keeps each step's check small."""
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise bad("options.stop must be a string or a list of non-empty strings", "options.stop")
    if len(stops) > MAX_STOP:
        raise bad(f"options.stop holds {len(stops)} strings; at most {MAX_STOP}", "options.stop")
    return tuple(stops)


def _context(v: dict, limits: Limits) -> KVPolicy | None:
    ctx = int_field(v, "num_ctx", 1, 2**31 - 1)
    keep = int_field(v, "num_keep", 0, 2**31 - 1)
    if ctx is None or (limits.context_length is not None and ctx >= limits.context_length):
        return None
    try:
        return KVPolicy.from_flags(max_kv_size=ctx, sinks=4 if keep is None else keep)
    except PolicyError as e:
        raise bad(
            f"options.num_ctx {ctx} with num_keep {4 if keep is None else keep}: {e}",
            "options.num_ctx",
            "invalid_policy",
        ) from None


def _format(v) -> str | None:
    """``format``: "json" holds the answer to a JSON object, a JSON Schema to the schema."""
    if v in (None, ""):
        return None
    if v == "json":
        return schema_grammar(None, "format")
    if not isinstance(v, dict):
        raise bad(f'format must be "json" or a JSON Schema object, got {show(v)}', "format")
    return schema_grammar(v, "format")


def _think(v) -> dict:
    """``think``: true/false as the chat template's ``enable_thinking`` (Qwen3's switch), a
    level as ``reasoning_effort`` (gpt-oss's); the thinking comes apart from the answer
    either way when the model has think markers."""
    if v is None:
        return {}
    if isinstance(v, bool):
        return {"enable_thinking": v}
    if v in THINK_LEVELS:
        return {"reasoning_effort": v}
    raise bad(f"think must be true, false, or one of {', '.join(THINK_LEVELS)}, got {show(v)}")


MESSAGE_FIELDS = (
    "role",
    "content",
    "thinking",
    "tool_calls",
    "tool_name",
    "tool_call_id",
    "images",
)


def _messages(v) -> list[dict]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad("messages must be a list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with role and content", where)
        for k, x in m.items():
            if k == "images" and x:
                raise bad(f"{where}.images: images are not supported: the model reads text", where)
            if k not in MESSAGE_FIELDS:
                raise bad(f"{where}.{k} is not a field of a message", f"{where}.{k}")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(
                f"{where}.role must be system, user, assistant or tool, got {show(role)}",
                f"{where}.role",
            )
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string", f"{where}.content")
        message = {"role": role, "content": content}
        if role == "assistant" and m.get("thinking"):
            message["reasoning_content"] = str(m["thinking"])
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = assistant_calls(m["tool_calls"], where)
        if role == "tool" and m.get("tool_name") is not None:
            message["name"] = m["tool_name"]
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tools(v) -> ToolUse:
    """``tools``: function tools as OpenAI's chat API writes them (Ollama's shape); the
    model decides whether to call one."""
    out, seen = [], set()
    for i, t in enumerate(tool_list(v)):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise bad(f"{where} must be {{type: 'function', function: {{name, ...}}}}", where)
        fn = function_of(fn, f"{where}.function", seen, "parameters")
        out.append({"type": "function", "function": fn})
    return ToolUse(tools=out)


# -- answers ------------------------------------------------------------------------------
class Reply:
    """One answer as Ollama's objects: a line per part while it streams, then a last line
    with ``done: true``, the reason and the timings (nanoseconds)."""

    def __init__(self, model: str, chat: bool):
        self.model = model
        self.chat = chat
        self.started = time.perf_counter_ns()
        self.id = f"ollama-{self.started}"  # for the server's log line

    def loaded(self) -> dict:
        """The answer to a request with nothing to answer (a client loading the model)."""
        return {**self._head(Part()), "done_reason": "load", "done": True}

    def line(self, part: Part) -> str:
        return json.dumps(self._head(part), ensure_ascii=False, separators=(",", ":")) + "\n"

    def last(self, c: Choice) -> str:
        obj = {**self._head(Part()), **self._tail(c)}
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"

    def whole(self, c: Choice) -> dict:
        part = Part(text="".join(c.text), reasoning="".join(c.reasoning), calls=c.calls)
        out = {**self._head(part), **self._tail(c)}
        if c.logprobs:
            out["logprobs"] = [without_bytes(e) for e in c.logprobs]
        return out

    def _head(self, part: Part) -> dict:
        head = {"model": self.model, "created_at": now()}
        text, calls = part.text, []
        for call in part.calls:
            try:
                args = json.loads(call["function"]["arguments"])
            except ValueError:
                args = None
            if isinstance(args, dict):
                fn = {"index": call.get("index", len(calls)), "name": call["function"]["name"]}
                calls.append({"id": call["id"], "function": {**fn, "arguments": args}})
            else:  # no object to give as arguments: the call as the model wrote it
                text += json.dumps(call["function"], ensure_ascii=False)
        if self.chat:
            message = {"role": "assistant", "content": text}
            if part.reasoning:
                message["thinking"] = part.reasoning
            if calls:
                message["tool_calls"] = calls
            head["message"] = message
        else:
            head["response"] = text
            if part.reasoning:
                head["thinking"] = part.reasoning
        if part.entry is not None:
            head["logprobs"] = [without_bytes(part.entry)]
        head["done"] = False
        return head

    def _tail(self, c: Choice) -> dict:
        s = c.stats or Stats()
        fresh = s.prompt_tokens - s.prompt_tokens_cached
        return {
            "done": True,
            "done_reason": FINISH_REASONS.get(c.finish_reason, c.finish_reason),
            "total_duration": time.perf_counter_ns() - self.started,
            "load_duration": 0,
            # the whole prompt, as Ollama counts it (clients show it as the prompt's usage);
            # its duration is that of the tokens the prefix cache did not serve
            "prompt_eval_count": s.prompt_tokens,
            "prompt_eval_duration": _ns(fresh, s.prompt_tps),
            "eval_count": s.generation_tokens,
            # the engine times the tokens after the first (which the prompt's pass gives)
            "eval_duration": _ns(max(s.generation_tokens - 1, 0), s.generation_tps),
            "mlxkv": {
                "prompt_tokens": s.prompt_tokens,
                "prompt_tokens_cached": s.prompt_tokens_cached,
                **kv_figures(s),
            },
        }


def _ns(tokens: int, per_second: float) -> int:
    return int(tokens / per_second * 1e9) if per_second > 0 else 0


def error_line(e: APIError) -> str:
    """A stream's last line when the answer cannot go on (the client raises it)."""
    return json.dumps({"error": e.message}, ensure_ascii=False) + "\n"


# -- the model ----------------------------------------------------------------------------
def details(facts: dict) -> dict:
    """The served model as Ollama's ``details``."""
    return {
        "parent_model": "",
        "format": "mlx",
        "family": facts.get("family", ""),
        "families": [facts["family"]] if facts.get("family") else None,
        "parameter_size": facts.get("parameter_size", ""),
        "quantization_level": facts.get("quantization_level", ""),
    }


def listing(name: str, facts: dict, modified: str) -> dict:
    """The served model as ``/api/tags`` lists it."""
    return {
        "name": name,
        "model": name,
        "modified_at": modified,
        "size": facts.get("size", 0),
        "digest": facts.get("digest", ""),
        "details": details(facts),
    }


def model_info(facts: dict, name: str) -> dict:
    """``/api/show``'s ``model_info``: GGUF-style keys (what clients read the context length
    from: ``<architecture>.context_length``; the name they show: ``general.basename``)."""
    arch = facts.get("family") or "unknown"
    info = {"general.architecture": arch, "general.basename": name}
    if facts.get("parameter_count"):
        info["general.parameter_count"] = facts["parameter_count"]
    for key in ("context_length", "embedding_length", "block_count"):
        if facts.get(key) is not None:
            info[f"{arch}.{key}"] = facts[key]
    return info


def served_name(name: str, serves: Callable[[str], bool]) -> str | None:
    """A request's model name without Ollama's default tag (``:latest``), when it names the
    served model."""
    for n in (name, name.removesuffix(":latest")):
        if serves(n):
            return n
    return None
