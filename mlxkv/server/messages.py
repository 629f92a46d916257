"""Anthropic's Messages API (``POST /v1/messages``), the one clients built on Anthropic's
SDKs speak: a request is checked and turned into the same ``Ask`` as a chat completion
(its blocks into the messages a chat template reads), and the answer into a ``message``
of content blocks (thinking, text, tool_use) or the stream events that build one.

As on the OpenAI side, every field is either honoured or refused with a 400 that names it.
"""

from __future__ import annotations

import json
from dataclasses import replace

from starlette.responses import JSONResponse

from mlxkv.engine.events import Stats
from mlxkv.server.answers import Choice, Part, kv_figures, new_id
from mlxkv.server.errors import APIError, bad
from mlxkv.server.params import (
    MAX_STOP,
    Ask,
    Limits,
    answer_grammar,
    int_field,
    model_of,
    number_field,
    policy_of,
    schema_grammar,
    settings_of,
    show,
    template_kwargs_of,
)
from mlxkv.server.tools import ANY, ToolUse, function_of, tool_list

MIN_THINKING_BUDGET = 1024  # as Anthropic's API
SERVICE_TIERS = ("auto", "standard_only")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING = ("enabled", "disabled", "adaptive", "between_tools")

COUNTED = {  # the fields of a token count (POST /v1/messages/count_tokens)
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "speed",
    "user_profile_id",
    "cache_control",  # a hint: the prefix cache serves every request's prefix anyway
    "context_management",  # only edits that change nothing (Claude Code's): see below
    "chat_template_kwargs",
}
HONOURED = COUNTED | {
    "max_tokens",
    "stop_sequences",
    "stream",
    "metadata",
    "service_tier",
    # sampling: gone from Anthropic's newest SDKs, still sent by clients built on others
    "temperature",
    "top_p",
    "top_k",
    # extensions, as on /v1/chat/completions
    "kv",
    "seed",
    "min_p",
    "repetition_penalty",
}
# fields of Anthropic's platform that a local server has no counterpart for
PLATFORM = {
    "container": "containers (code execution) are not supported",
    "diagnostics": "prompt-cache diagnostics are not supported",
    "inference_geo": "this server runs on this machine; leave inference_geo out",
    "workspace_id": "this server has no workspaces; leave workspace_id out",
}

# Anthropic's error types by status: {"type": "error", "error": {"type", "message"}}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
STOP_REASONS = {
    "stop": "end_turn",
    "stop_string": "stop_sequence",
    "length": "max_tokens",
    "context": "model_context_window_exceeded",  # the answer filled the model's context
}


def error_body(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


# -- requests -----------------------------------------------------------------------------
def _context_management(v) -> None:
    """``context_management``: the edits Anthropic's servers make to a long conversation
    before the model reads it. Clearing thinking while keeping all of it (Claude Code sends
    that) changes nothing; any other edit would, and is refused."""
    if v is None:
        return
    edits = v.get("edits") if isinstance(v, dict) and set(v) <= {"edits"} else None
    if not isinstance(edits, list):
        raise bad("context_management must be {edits: [...]}", "context_management")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        keeps_all = isinstance(kind, str) and kind.startswith("clear_thinking_")
        if not (keeps_all and edit.get("keep") == "all"):
            raise bad(
                f"context_management.edits[{i}]: only clear_thinking with keep 'all' (no "
                "change) is supported; the model reads the messages as sent",
                "context_management",
            )


def parse_messages(body: dict, limits: Limits, counting: bool = False) -> Ask:
    """A Messages request (or, ``counting``, a count_tokens request) as the server's Ask."""
    allowed = COUNTED if counting else HONOURED
    for name, value in body.items():
        if name in PLATFORM and value is not None:
            raise bad(f"{name}: {PLATFORM[name]}", param=name)
        if name not in allowed and name not in PLATFORM:
            raise bad(f"{name}: Extra inputs are not permitted", param=name)
    if "messages" not in body:
        raise bad("messages: Field required (a list of {role, content} objects)", "messages")
    max_tokens = None
    if not counting:
        if body.get("max_tokens") is None:
            raise bad("max_tokens: Field required (the most tokens to generate)", "max_tokens")
        max_tokens = int_field(body, "max_tokens", 0, 2**31 - 1, "0 only fills the cache")
    _context_management(body.get("context_management"))
    messages, prefill = _messages(body["messages"])
    system = _system(body.get("system"))
    tools = _tools(body)
    thinking, shown, budget = _thinking(body, max_tokens)
    effort, grammar = _output_config(body.get("output_config"))
    grammar = answer_grammar(tools, grammar)
    kwargs = {**thinking, **effort, **template_kwargs_of(body.get("chat_template_kwargs"))}
    if counting:
        settings = limits.defaults
    else:
        number_field(body, "temperature", 0, 1, hint="0 means greedy")
        sampling = {k: body.get(k) for k in ("temperature", "top_p", "top_k", "min_p", "seed")}
        sampling["repetition_penalty"] = body.get("repetition_penalty")
        sampling["stop"] = _stop_sequences(body.get("stop_sequences"))
        # max_tokens 0 (warming the cache): one token is decoded and not sent
        settings = settings_of(sampling, limits, max_tokens or 1)
        # an answer that continues the assistant's own text keeps its first space
        settings = replace(settings, continues=prefill, grammar=grammar)
        if budget is not None:  # else the server's --thinking-budget, if any
            settings = replace(settings, think_budget=budget)
    _check_plain(body)
    profile = _string(body, "user_profile_id")
    return Ask(
        kind="messages",
        model=model_of(body),
        settings=settings,
        policy=None if counting else policy_of(body),
        logprobs=None,
        stream=bool(_flag(body, "stream")),
        messages=system + messages,
        template_kwargs=kwargs,
        user=_user_id(body.get("metadata")) or profile,
        tools=tools,
        continue_final=prefill,
        warm_only=max_tokens == 0,
        show_thinking=shown,
    )


def _check_plain(body: dict) -> None:
    """The fields whose only meaning here is their default: one service tier, one speed;
    and the cache hint, checked."""
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise bad(
            f"service_tier must be 'auto' or 'standard_only', got {show(tier)}", "service_tier"
        )
    speed = body.get("speed")
    if speed not in (None, "standard"):
        raise bad(
            f"speed {show(speed)}: this server has one speed; send 'standard' or leave it out",
            "speed",
        )
    hint = body.get("cache_control")
    if hint is not None:
        ok = isinstance(hint, dict) and hint.get("type") == "ephemeral"
        if not ok or set(hint) - {"type", "ttl"} or hint.get("ttl") not in (None, "5m", "1h"):
            raise bad(
                "cache_control must be {type: 'ephemeral'} with an optional ttl '5m' or '1h'",
                "cache_control",
            )


def _string(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad(f"{name} must be a string, got {show(v)}", name)
    return v or None


def _flag(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {show(v)}", name)
    return v


def _stop_sequences(v) -> list[str] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise bad("stop_sequences must be a list of non-empty strings", "stop_sequences")
    if len(v) > MAX_STOP:
        raise bad(f"stop_sequences takes at most {MAX_STOP}, got {len(v)}", "stop_sequences")
    return v


def _user_id(v) -> str | None:
    if v is None:
        return None
    if not isinstance(v, dict) or any(k != "user_id" for k in v):
        raise bad('metadata must be {"user_id": "..."}; it has no other field', "metadata")
    user = v.get("user_id")
    if user is not None and not isinstance(user, str):
        raise bad("metadata.user_id must be a string", "metadata.user_id")
    return user or None


def _text_blocks(v, where: str) -> str:
    """A string, or a list of text blocks (``cache_control`` allowed: the prefix cache
    serves every request's prefix anyway), as one text."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(f"{where} must be a string or a list of text blocks", where)
    return "\n".join(_text(b, f"{where}[{i}]") for i, b in enumerate(v))


def _text(block, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else None
        raise bad(
            f"{where}: only text blocks are supported here"
            + (f" (got '{kind}')" if isinstance(kind, str) else ""),
            where,
        )
    _only(block, {"type", "text", "cache_control", "citations"}, where)
    if not isinstance(block.get("text"), str):
        raise bad(f"{where}.text must be a string", f"{where}.text")
    return block["text"]


def _only(block: dict, keys: set[str], where: str) -> None:
    for k in block:
        if k not in keys:
            raise bad(f"{where}.{k}: Extra inputs are not permitted", f"{where}.{k}")


def _system(v) -> list[dict]:
    if v is None:
        return []
    text = _text_blocks(v, "system")
    return [{"role": "system", "content": text}]


def _messages(v) -> tuple[list[dict], bool]:
    """The conversation as the chat template reads it (tool results as ``tool`` messages,
    tool uses as ``tool_calls``, thinking as ``reasoning_content``), and whether the last
    message is the assistant's own start of its answer (a prefill, to be continued)."""
    if not isinstance(v, list) or not v:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out: list[dict] = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with role and content", where)
        _only(m, {"role", "content"}, where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role must be 'user' or 'assistant', got {show(role)}", where)
        content = m.get("content")
        final_assistant = role == "assistant" and i == len(v) - 1
        if content in ("", []) and not final_assistant:  # as Anthropic's API refuses it
            raise bad(
                f"{where}: all messages must have non-empty content except for the optional "
                "final assistant message",
                f"{where}.content",
            )
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += (_user if role == "user" else _assistant)(content, where)
        else:
            raise bad(f"{where}.content must be a string or a list of blocks", f"{where}.content")
    prefill = v[-1].get("role") == "assistant"
    if prefill and out[-1].get("tool_calls"):
        raise bad(
            "the last message is the assistant's tool_use: send the tool_result in a user "
            "message after it",
            f"messages[{len(v) - 1}]",
        )
    return out, prefill


def _user(blocks: list, where: str) -> list[dict]:
    """A user message's blocks: each tool_result its own ``tool`` message, the text
    between them a user message."""
    out: list[dict] = []
    text: list[str] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(b, dict) and b.get("type") == "tool_result":
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            out.append(_tool_result(b, at))
        else:
            text.append(_text(b, at))
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _tool_result(b: dict, at: str) -> dict:
    _only(b, {"type", "tool_use_id", "content", "is_error", "cache_control"}, at)
    call_id = b.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{at}.tool_use_id must be the id of the tool_use it answers", at)
    content = b.get("content")
    text = "" if content is None else _text_blocks(content, f"{at}.content")
    is_error = b.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad(f"{at}.is_error must be true or false", f"{at}.is_error")
    if is_error:  # chat templates have no field for it: the model reads it in the result
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant(blocks: list, where: str) -> list[dict]:
    text, thought, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_use":
            _only(b, {"type", "id", "name", "input", "cache_control"}, at)
            call_id, name, args = b.get("id"), b.get("name"), b.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise bad(f"{at} must be {{type: 'tool_use', id, name, input}}", at)
            if not isinstance(args, dict):
                raise bad(f"{at}.input must be an object", f"{at}.input")
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
        elif kind == "thinking":
            _only(b, {"type", "thinking", "signature"}, at)
            if not isinstance(b.get("thinking"), str):
                raise bad(f"{at}.thinking must be a string", f"{at}.thinking")
            thought.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue  # Claude's encrypted reasoning: nothing a local model can read
        else:
            text.append(_text(b, at))
    out = {"role": "assistant", "content": "".join(text)}
    if thought:
        out["reasoning_content"] = "".join(thought)
    if calls:
        out["tool_calls"] = calls
    return [out]


def _tools(body: dict) -> ToolUse:
    tools = tool_list(body.get("tools"), "{name, description, input_schema}")
    functions, seen, strict = [], set(), []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f"{where} must be an object {{name, description, input_schema}}", where)
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise bad(
                f"{where}: '{kind}' is a tool Anthropic's servers run; this server takes "
                "client tools only ({name, description, input_schema})",
                f"{where}.type",
            )
        _only(t, {"type", "name", "description", "input_schema", "cache_control", "strict"}, where)
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"{where}.input_schema must be a JSON Schema object", where)
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise bad(f"{where}.strict must be true or false", f"{where}.strict")
        fn = function_of(t, where, seen, "input_schema", longest=128)
        functions.append({"type": "function", "function": fn})
        strict += [fn["name"]] if t.get("strict") else []
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is not None and kind not in ("auto", "none", "any", "tool"):
        raise bad(
            "tool_choice must be {type: 'auto'}, {type: 'any'}, {type: 'tool', name} or "
            f"{{type: 'none'}}, got {show(choice)}",
            "tool_choice",
        )
    parallel, forced = True, None
    if choice is not None:
        _only(choice, {"type", "disable_parallel_tool_use", "name"}, "tool_choice")
        off = choice.get("disable_parallel_tool_use")
        if off is not None and not isinstance(off, bool):
            raise bad("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
        parallel = not off
        if kind == "any" and not seen:
            raise bad("tool_choice {type: 'any'} needs tools to call", "tool_choice")
        name = choice.get("name")
        if kind == "tool" and (not isinstance(name, str) or name not in seen):
            raise bad(
                f"tool_choice names {show(name)}, which is not among the tools", "tool_choice"
            )
        forced = ANY if kind == "any" else name if kind == "tool" else None
    if kind == "none":
        functions = []
    return ToolUse(functions, parallel, forced, frozenset(strict))


def _thinking(body: dict, max_tokens: int | None) -> tuple[dict, bool, int | None]:
    """``thinking`` as chat template arguments, ``enable_thinking`` (the switch of Qwen3's
    and similar templates: "adaptive" and "between_tools" leave the template's default),
    whether the answer shows the thinking's text (``display: "omitted"`` does not), and
    the thinking budget (``budget_tokens``: the think block is closed at it)."""
    v = body.get("thinking")
    if v is None:
        return {}, True, None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in THINKING:
        raise bad(f"thinking.type must be one of {', '.join(THINKING)}, got {show(v)}", "thinking")
    keys = {"enabled": {"budget_tokens", "display"}, "adaptive": {"display"}}.get(kind, set())
    _only(v, {"type"} | keys, "thinking")
    display = v.get("display")
    if display not in (None, "summarized", "omitted"):
        raise bad(
            f"thinking.display must be 'summarized' or 'omitted', got {show(display)}",
            "thinking.display",
        )
    budget = None
    if kind == "enabled":
        budget = int_field(v, "budget_tokens", MIN_THINKING_BUDGET, 2**31 - 1)
        if budget is None:
            raise bad("thinking.budget_tokens: Field required", "thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise bad(
                f"max_tokens ({max_tokens}) must be greater than thinking.budget_tokens ({budget})",
                "thinking.budget_tokens",
            )
    switch = {"enabled": {"enable_thinking": True}, "disabled": {"enable_thinking": False}}
    return switch.get(kind, {}), display != "omitted", budget


def _output_config(v) -> tuple[dict, str | None]:
    """``output_config``: its ``effort`` as the chat template argument ``reasoning_effort``
    (gpt-oss's templates read it), and its ``format`` ({type: "json_schema", schema}) as
    the grammar the answer is held to."""
    if v is None:
        return {}, None
    if not isinstance(v, dict):
        raise bad("output_config must be an object {effort, format}", "output_config")
    _only(v, {"effort", "format"}, "output_config")
    grammar = None
    form = v.get("format")
    if form is not None:
        ok = isinstance(form, dict) and form.get("type") == "json_schema"
        if not ok or set(form) - {"type", "schema"} or not isinstance(form.get("schema"), dict):
            raise bad(
                "output_config.format must be {type: 'json_schema', schema: {...}}",
                "output_config.format",
            )
        grammar = schema_grammar(form["schema"], "output_config.format.schema")
    effort = v.get("effort")
    if effort is None:
        return {}, grammar
    if effort not in EFFORTS:
        raise bad(
            f"output_config.effort must be one of {', '.join(EFFORTS)}, got {show(effort)}",
            "output_config.effort",
        )
    return {"reasoning_effort": effort}, grammar


# -- answers ------------------------------------------------------------------------------
def usage(s: Stats | None) -> dict:
    """Anthropic's usage (input tokens not served by the prefix cache, those it served,
    output tokens) and mlxkv's KV figures."""
    s = s or Stats()
    return {
        "input_tokens": s.prompt_tokens - s.prompt_tokens_cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": s.prompt_tokens_cached,
        "output_tokens": s.generation_tokens,
        "mlxkv": kv_figures(s),
    }


class Message:
    """One answer as Anthropic's content blocks, built from the parts it arrives in; each
    ``add`` returns the stream events (``(name, data)``) that the parts make.

    A text block opens at the first text that is not whitespace (the blank lines a model
    writes after its thinking or around a tool call make no block of their own)."""

    def __init__(self, model: str, show_thinking: bool = True):
        self.id = new_id("msg").replace("-", "_")
        self.model = model
        self.show_thinking = show_thinking  # False: thinking blocks without their text
        self.blocks: list[dict] = []
        self.open: str | None = None  # the type of the block still taking deltas
        self.blank = ""  # whitespace held until text follows it

    def head(self, stats: Stats | None) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(stats),
        }

    def start(self, stats: Stats) -> list[tuple[str, dict]]:
        """The stream's first event, with the prompt's tokens (known once it ran)."""
        msg = self.head(replace(stats, generation_tokens=0))
        del msg["usage"]["mlxkv"]
        return [("message_start", {"type": "message_start", "message": msg})]

    def add(self, part: Part) -> list[tuple[str, dict]]:
        events = []
        if part.reasoning:
            events += self._write("thinking", part.reasoning if self.show_thinking else "")
        if part.text:
            text, self.blank = self.blank + part.text, ""
            if self.open == "text" or text.strip():
                events += self._write("text", text)
            else:
                self.blank = text
        for call in part.calls:
            events += self._close()
            events += self._call(call)
        return events

    def end(self, c: Choice) -> list[tuple[str, dict]]:
        delta = {"stop_reason": self.stop_reason(c), "stop_sequence": c.stop}
        tally = usage(c.stats)
        return [
            *self._close(),
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": tally}),
            ("message_stop", {"type": "message_stop"}),
        ]

    def fail(self, e: APIError) -> list[tuple[str, dict]]:
        """The stream's last event when the answer cannot go on."""
        return [("error", error_body(e))]

    def whole(self, c: Choice) -> dict:
        self._close()
        return {
            **self.head(c.stats),
            "content": self.blocks,
            "stop_reason": self.stop_reason(c),
            "stop_sequence": c.stop,
        }

    def stop_reason(self, c: Choice) -> str | None:
        if c.finish_reason is None:
            return None
        if c.calls and c.finish_reason == "stop":
            return "tool_use"
        return STOP_REASONS.get(c.finish_reason, "end_turn")

    def _write(self, kind: str, text: str) -> list[tuple[str, dict]]:
        events = []
        if self.open != kind:
            events += self._close()
            block = {"type": "text", "text": ""}
            if kind == "thinking":
                block = {"type": "thinking", "thinking": "", "signature": ""}
            events.append(self._start(block))
            self.open = kind
        if text:
            self.blocks[-1][kind] += text
            delta = {"type": f"{kind}_delta", kind: text}
            events.append(("content_block_delta", self._at({"type": "content_block_delta"}, delta)))
        return events

    def _call(self, call: dict) -> list[tuple[str, dict]]:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = None
        if not isinstance(args, dict):  # no object to give as input: the call as text
            written = json.dumps({"name": fn["name"], "arguments": fn["arguments"]})
            return [*self._write("text", written), *self._close()]
        block = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
        events = [self._start(block)]
        block["input"] = args
        delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
        events.append(("content_block_delta", self._at({"type": "content_block_delta"}, delta)))
        self.open = "tool_use"
        return [*events, *self._close()]

    def _start(self, block: dict) -> tuple[str, dict]:
        self.blocks.append(block)
        event = {"type": "content_block_start", "index": len(self.blocks) - 1}
        return "content_block_start", {**event, "content_block": dict(block)}

    def _at(self, event: dict, delta: dict) -> dict:
        return {**event, "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        index = len(self.blocks) - 1
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]


def event(name: str, data: dict) -> str:
    """One server-sent event as Anthropic's and the Responses API's streams send it: its
    name, then its data."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
