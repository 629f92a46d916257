"""OpenAI's Responses API (``POST /v1/responses``), the one the newest OpenAI clients and
agent frameworks speak: a request's ``input`` items are checked and turned into the same
``Ask`` as a chat completion (messages, function calls and their outputs, reasoning, as
the chat template reads them), and the answer into a ``response`` of output items
(reasoning, message, function_call) or the stream events that build one.

As on the other endpoints, every field is either honoured or refused with a 400 that
names it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from mlxkv.engine.events import Stats
from mlxkv.server.answers import Choice, Part, kv_figures, new_id, without_bytes
from mlxkv.server.errors import APIError, bad
from mlxkv.server.params import (
    EFFORTS,
    MAX_TOP_LOGPROBS,
    ROLES,
    VERBOSITY,
    Ask,
    Limits,
    answer_grammar,
    bool_field,
    cache_hints,
    int_field,
    model_of,
    policy_of,
    schema_grammar,
    settings_of,
    show,
    template_kwargs_of,
    user_of,
)
from mlxkv.server.response_store import STORE_BYTES
from mlxkv.server.tools import ANY, NAME, ToolUse, function_of, tool_list

MAX_METADATA = 16  # as OpenAI's API: keys, each up to 64 characters, values up to 512
LOGPROBS = "message.output_text.logprobs"
# reasoning items carry their text in ``content``, so there is nothing to encrypt
INCLUDES = (LOGPROBS, "reasoning.encrypted_content")
SUMMARIES = ("auto", "concise", "detailed")
# Tools that OpenAI's platform runs itself, or that only its own models are trained to
# call: clients (Codex) list them with their function tools. The model here is not
# offered them; the response echoes them.
HOSTED_TOOLS = {
    "file_search",
    "computer_use",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "local_shell",
    "shell",
    "apply_patch",
    "mcp",
}
# A custom (freeform) tool takes one string; the chat template offers it as a function
# with this one parameter.
CUSTOM_INPUT = "input"

COUNTED = {  # the fields of a token count (POST /v1/responses/input_tokens)
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "conversation",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning",
    "text",
    "truncation",
    "chat_template_kwargs",
}
HONOURED = COUNTED | {
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_logprobs",
    "include",
    "stream",
    "stream_options",
    "store",
    "metadata",
    "user",
    "safety_identifier",
    "service_tier",
    "background",
    "max_tool_calls",
    "client_metadata",  # the client's own labels (Codex sends its installation id)
    # prompt-caching hints: the prefix cache matches requests by their tokens
    "prompt_cache_key",
    "prompt_cache_retention",
    # extensions, as on /v1/chat/completions
    "kv",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
}
# fields of OpenAI's platform that a local server has no counterpart for
PLATFORM = {
    "prompt": "prompt templates are not supported; send instructions and input",
    "context_management": "context management (compaction) is not supported",
    "background_options": "background options are not supported; send background: true alone",
    "access_programs": "programs are not supported",
    "image": "image generation is not supported",
    "moderation": "moderation is not supported",
    "prompt_cache_options": "prompt cache options are not supported; the prefix cache "
    "serves every request's prefix",
    "personality": "personality presets are not supported; send instructions",
}


Find = Callable[[str, str | None], dict | None]  # (item id, conversation id) -> the item


@dataclass
class Turn:
    """What a Responses request adds to its Ask: what the response object echoes, the
    items to store, and the conversation before this answer."""

    request: dict  # the request's fields a response object repeats
    items: list[dict] = field(default_factory=list)  # the input items, each with an id
    messages: list[dict] = field(default_factory=list)  # the input as chat messages
    previous: str | None = None
    store: bool = True
    truncate: bool = False  # truncation "auto": the oldest turns go where the input is too long
    background: bool = False  # answered after the request returns; read with GET /v1/responses/{id}
    custom: frozenset[str] = frozenset()  # the names of custom tools: their calls are text
    conversation: str | None = None  # the id of the conversation it reads and adds to


def parse_responses(
    body: dict, limits: Limits, counting: bool = False, find: Find | None = None
) -> tuple[Ask, Turn]:
    """A Responses request (or, ``counting``, an input_tokens request) as the server's Ask
    and the Turn it belongs to. ``Ask.messages`` holds the instructions and this input;
    the server puts the stored conversation of ``previous_response_id`` between them.
    ``find`` looks up the items that ``item_reference`` items name."""
    allowed = COUNTED if counting else HONOURED
    for name, value in body.items():
        if name in PLATFORM and value is not None:
            raise bad(f"{name}: {PLATFORM[name]}", name, "unsupported_parameter")
        if name not in allowed and name not in PLATFORM:
            raise bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    if all(body.get(k) is None for k in ("input", "previous_response_id", "conversation")):
        raise bad("input is required: a string or a list of input items", "input")
    conversation = _conversation(body.get("conversation"))
    lookup = None if find is None else lambda item_id: find(item_id, conversation)
    items = parse_items(body.get("input"), find=lookup)
    messages = input_messages(items)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad(f"instructions must be a string, got {show(instructions)}", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad("previous_response_id must be a response id", "previous_response_id")
    if conversation is not None and previous is not None:
        raise bad(
            "previous_response_id and conversation cannot be used together: the conversation "
            "holds the turns before this one; send one of them",
            "conversation",
        )
    tools, offered = _tools(body)
    effort, summary = _reasoning(body.get("reasoning"))
    grammar, form, verbosity = _text(body.get("text"))
    grammar = answer_grammar(tools, grammar)
    truncation = body.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise bad(f"truncation must be 'auto' or 'disabled', got {show(truncation)}", "truncation")
    kwargs = {**effort, **template_kwargs_of(body.get("chat_template_kwargs"))}
    logprobs, top = False, 0
    settings = limits.defaults
    stream = background = False
    if not counting:
        max_tokens = int_field(body, "max_output_tokens", 1, 2**31 - 1)
        settings = replace(settings_of(body, limits, max_tokens), grammar=grammar)
        top = int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        logprobs = LOGPROBS in _include(body.get("include"))
        stream = bool(bool_field(body, "stream"))
        _stream_options(body, stream)
        _check_plain(body)
        background = bool(bool_field(body, "background"))
        if background and body.get("store") is False:
            raise bad("background responses are stored: leave store out or set it true", "store")
        cache_hints(body)
    user = user_of(body, "user", "safety_identifier")
    request = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata_of(body.get("metadata")),
        "parallel_tool_calls": tools.parallel,
        "previous_response_id": previous,
        "reasoning": {"effort": effort.get("reasoning_effort"), "summary": summary},
        "store": body.get("store") is not False,
        "temperature": settings.temperature,
        "text": {"format": form, "verbosity": verbosity},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": offered,
        "top_logprobs": top,
        "top_p": settings.top_p,
        "truncation": truncation or "disabled",
        "user": body.get("user"),
        "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "service_tier": "default",
        "background": background,
    }
    if conversation is not None:
        request["conversation"] = {"id": conversation}
    ask = Ask(
        kind="responses",
        model=model_of(body),
        settings=settings,
        policy=None if counting else policy_of(body),
        logprobs=top if logprobs else None,
        stream=stream,
        messages=system + messages,
        template_kwargs=kwargs,
        user=user,
        tools=tools,
    )
    custom = frozenset(t["name"] for t in offered if t["type"] == "custom")
    turn = Turn(
        request,
        items,
        messages,
        previous,
        request["store"],
        truncation == "auto",
        custom=custom,
        background=background,
        conversation=conversation,
    )
    return ask, turn


def _conversation(v) -> str | None:
    """``conversation``: a conversation's id, or ``{id}``."""
    if isinstance(v, dict) and set(v) == {"id"}:
        v = v["id"]
    if v is not None and (not isinstance(v, str) or not v):
        raise bad(
            f"conversation must be a conversation id or {{id}}, got {show(v)}", "conversation"
        )
    return v


def _check_plain(body: dict) -> None:
    """The fields whose only meaning here is their default."""
    bool_field(body, "store")
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise bad(
            f"service_tier {show(tier)}: there is one service tier; send 'auto' or leave it out",
            "service_tier",
        )
    # max_tool_calls bounds calls of OpenAI's built-in tools; this server runs none
    int_field(body, "max_tool_calls", 1, 2**31 - 1)


def _stream_options(body: dict, stream: bool) -> None:
    opts = body.get("stream_options")
    if opts is None:
        return
    if not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_obfuscation"}:
        raise bad("stream_options takes include_obfuscation only", "stream_options")
    # obfuscation pads events against length side channels on the open internet; a
    # local server sends none and accepts either value
    bool_field(opts, "include_obfuscation")


def _include(v) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise bad("include must be a list of strings", "include")
    for x in v:
        if x not in INCLUDES:
            raise bad(
                f"include {show(x)} is not supported; this server can include "
                + " and ".join(INCLUDES),
                "include",
            )
    return v


def metadata_of(v) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_METADATA:
        raise bad(f"metadata must be an object of at most {MAX_METADATA} keys", "metadata")
    for k, x in v.items():
        if len(k) > 64 or not isinstance(x, str) or len(x) > 512:
            raise bad(
                f"metadata.{k[:64]}: keys are at most 64 characters and values strings of "
                "at most 512",
                "metadata",
            )
    return dict(v)


def _reasoning(v) -> tuple[dict, str | None]:
    """``reasoning``: its effort as chat template arguments (as ``reasoning_effort`` on chat
    completions), and its summary setting, echoed: reasoning items carry the model's whole
    reasoning text, so nothing is summarised."""
    if v is None:
        return {}, None
    if not isinstance(v, dict):
        raise bad("reasoning must be an object {effort, summary}", "reasoning")
    for k, x in v.items():
        if k not in ("effort", "summary", "generate_summary") and x is not None:
            raise bad(f"reasoning.{k} is not supported; send effort and summary", "reasoning")
    summary = v.get("summary") or v.get("generate_summary")
    if summary is not None and summary not in SUMMARIES:
        raise bad(
            f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {show(summary)}",
            "reasoning.summary",
        )
    effort = v.get("effort")
    if effort is None:
        return {}, summary
    if effort not in EFFORTS:
        raise bad(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {show(effort)}",
            "reasoning.effort",
        )
    off = {"enable_thinking": False} if effort == "none" else {}
    return {"reasoning_effort": effort, **off}, summary


def _text(v) -> tuple[str | None, dict, str]:
    """``text``: its format as the grammar the answer is held to ({type: "text"} none,
    {type: "json_object"} any JSON object, {type: "json_schema", name, schema, strict,
    description} JSON matching the schema), the format the response echoes, and the
    verbosity it echoes (a hint to OpenAI's own models; the model here answers at its
    own length)."""
    plain = {"type": "text"}
    if v is None:
        return None, plain, "medium"
    if not isinstance(v, dict) or set(v) - {"format", "verbosity"}:
        raise bad("text must be an object {format, verbosity}", "text")
    verbosity = v.get("verbosity") or "medium"
    if verbosity not in VERBOSITY:
        raise bad(
            f"text.verbosity must be one of {', '.join(VERBOSITY)}, got {show(verbosity)}",
            "text.verbosity",
        )
    form = v.get("format")
    kind = form.get("type") if isinstance(form, dict) else None
    if form is None or kind == "text":
        return None, plain, verbosity
    if kind == "json_object":
        return schema_grammar(None, "text.format"), {"type": "json_object"}, verbosity
    if kind != "json_schema":
        raise bad(
            "text.format.type must be 'text', 'json_object' or 'json_schema', got "
            f"{show(kind if kind is not None else form)}",
            "text.format",
        )
    for k in form:
        if k not in ("type", "name", "schema", "strict", "description"):
            raise bad(
                f"text.format.{k} is not a field; use name, schema, strict, description",
                "text.format",
            )
    name = form.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad("text.format.name must be 1 to 64 letters, digits, '_' or '-'", "text.format")
    if not isinstance(form.get("schema"), dict):
        raise bad("text.format.schema must be a JSON Schema object", "text.format.schema")
    if form.get("strict") is not None and not isinstance(form["strict"], bool):
        raise bad("text.format.strict must be true or false", "text.format.strict")
    return schema_grammar(form["schema"], "text.format.schema"), dict(form), verbosity


# -- tools --------------------------------------------------------------------------------
def _tools(body: dict) -> tuple[ToolUse, list[dict]]:
    """``tools`` (function tools: {type: "function", name, description, parameters,
    strict}; custom tools: {type: "custom", name, description, format}, which take one
    string; OpenAI's hosted tools, not offered), ``tool_choice`` and
    ``parallel_tool_calls``; and the tools as the response echoes them.

    ``strict`` (true unless sent false, as OpenAI's API has it) holds a call's arguments
    to the schema: a forced call's always, one the model chooses to make where its family
    writes calls as JSON (``tools.held_calls``)."""
    tools = tool_list(body.get("tools"))
    functions, echoed, seen = [], [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if isinstance(kind, str) and (kind in HOSTED_TOOLS or kind.startswith("web_search")):
            echoed.append(t)
            continue
        if kind == "custom":
            fn = _custom_tool(t, where, seen)
            functions.append({"type": "function", "function": fn})
            form = t.get("format") or {"type": "text"}
            echoed.append(
                {
                    "type": "custom",
                    "name": fn["name"],
                    "description": t.get("description"),
                    "format": form,
                }
            )
            continue
        if kind != "function":
            raise bad(
                f"{where} must be a function tool ({{type: 'function', name, parameters}})"
                + (f"; '{kind}' tools are not supported" if isinstance(kind, str) else ""),
                f"{where}.type",
            )
        for k in t:
            if k not in ("type", "name", "description", "parameters", "strict"):
                raise bad(f"{where}.{k} is not a field of a function tool", f"{where}.{k}")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise bad(f"{where}.strict must be true or false", f"{where}.strict")
        fn = function_of(t, where, seen, "parameters")
        functions.append({"type": "function", "function": fn})
        echoed.append(
            {
                "type": "function",
                "name": fn["name"],
                "description": t.get("description"),
                "parameters": t.get("parameters"),
                "strict": t.get("strict") is not False,
            }
        )
    forced = _forced(body.get("tool_choice"), seen)
    parallel = bool_field(body, "parallel_tool_calls")
    if body.get("tool_choice") == "none":
        functions = []
    strict = frozenset(t["name"] for t in echoed if t.get("type") == "function" and t["strict"])
    return ToolUse(functions, parallel is not False, forced, strict), echoed


def _custom_tool(t: dict, where: str, seen: set[str]) -> dict:
    """A custom tool as the function a chat template reads: one string parameter, whose
    description carries the tool's format (a grammar's definition, say), so the model
    knows what to write."""
    for k in t:
        if k not in ("type", "name", "description", "format"):
            raise bad(f"{where}.{k} is not a field of a custom tool", f"{where}.{k}")
    form = t.get("format")
    if form is None:
        form = {"type": "text"}
    if not isinstance(form, dict) or form.get("type") not in ("text", "grammar"):
        raise bad(
            f"{where}.format must be {{type: 'text'}} or {{type: 'grammar', syntax, "
            f"definition}}, got {show(form)}",
            f"{where}.format",
        )
    about = "Free text."
    if form["type"] == "grammar":
        syntax, definition = form.get("syntax"), form.get("definition")
        if not isinstance(syntax, str) or not isinstance(definition, str):
            raise bad(f"{where}.format: a grammar needs syntax and definition strings", where)
        about = f"Text matching this {syntax} grammar:\n{definition}"
    text = {"type": "string", "description": about}
    schema = {"type": "object", "properties": {CUSTOM_INPUT: text}, "required": [CUSTOM_INPUT]}
    return function_of({**t, "parameters": schema}, where, seen, "parameters")


def _forced(choice, names: set[str]) -> str | None:
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        if not names:
            raise bad("tool_choice 'required' needs tools to call", "tool_choice")
        return ANY
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    name = choice.get("name") if named else None
    if not isinstance(name, str) or set(choice) - {"type", "name"}:
        raise bad(
            "tool_choice must be 'auto', 'none', 'required' or {type: 'function' (or "
            f"'custom'), name}}, got {show(choice)}",
            "tool_choice",
        )
    if name not in names:
        raise bad(f"tool_choice names '{name}', which is not among the tools", "tool_choice")
    return name


# -- input items --------------------------------------------------------------------------
def parse_items(
    v, name: str = "input", find: Callable[[str], dict | None] | None = None
) -> list[dict]:
    """``input`` (or a conversation's ``items``: ``name``) as a list of items, each with an
    id (a string is one user message); an ``item_reference`` is the item ``find`` gives
    for its id (without ``find``, it is left for ``input_messages`` to refuse)."""
    if v is None:
        return []
    if isinstance(v, str):
        v = [{"role": "user", "content": v}]
    if not isinstance(v, list):
        raise bad(f"{name} must be a string or a list of input items", name)
    out = []
    for i, item in enumerate(v):
        if not isinstance(item, dict):
            raise bad(f"{name}[{i}] must be an object (an input item)", f"{name}[{i}]")
        kind = item.get("type", "message" if "role" in item else None)
        if kind is not None and not isinstance(kind, str):
            raise bad(f"{name}[{i}].type must be a string, such as 'message'", f"{name}[{i}].type")
        if kind == "item_reference" and find is not None:
            item = _referenced(item, f"{name}[{i}]", find)
            kind = item["type"]
        item = {**item, "type": kind, "id": item.get("id") or _item_id(kind)}
        if kind == "message" and isinstance(item.get("content"), str):  # as OpenAI lists it
            text = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": text, "text": item["content"]}]
        out.append(item)
    return out


def _referenced(item: dict, where: str, find: Callable[[str], dict | None]) -> dict:
    _only(item, {"type", "id"}, where)
    item_id = item.get("id")
    found = find(item_id) if isinstance(item_id, str) else None
    if found is None:
        raise bad(
            f"{where}: item_reference {show(item_id)} names no item this server holds (the "
            "input and output items of stored responses, and the conversation's items); "
            "send the item itself",
            f"{where}.id",
        )
    return _copy(found)


def _item_id(kind) -> str:
    prefix = {
        "function_call": "fc",
        "function_call_output": "fco",
        "custom_tool_call": "ctc",
        "custom_tool_call_output": "ctco",
        "reasoning": "rs",
    }
    return new_id(prefix.get(kind, "msg")).replace("-", "_")


def input_messages(items: list[dict], written: bool = False, name: str = "input") -> list[dict]:
    """Input (or stored output) items as the chat messages a template reads: a message as
    itself, function calls as the ``tool_calls`` of the assistant message before them,
    their outputs as ``tool`` messages, and a reasoning item as the ``reasoning_content``
    of the assistant turn after it. ``written``: the model's own output, whose calls keep
    arguments that are no JSON object as the text it wrote."""
    out: list[dict] = []
    thought: list[str] = []  # reasoning waiting for the assistant turn it belongs to

    def assistant() -> dict:
        if not (out and out[-1]["role"] == "assistant" and not thought):
            out.append({"role": "assistant", "content": ""})
        if thought:
            out[-1]["reasoning_content"] = "\n".join(thought)
            thought.clear()
        return out[-1]

    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        kind = item["type"]
        if kind == "message":
            role, text = _message(item, where)
            if role == "assistant":
                turn = assistant()
                turn["content"] += text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            call = _call(item, where, written)
            turn = assistant()
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "custom_tool_call":
            turn = assistant()
            turn.setdefault("tool_calls", []).append(_custom_call(item, where))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append(_call_output(item, where))
        elif kind == "reasoning":
            thought.append(_reasoning_text(item, where))
        elif kind == "item_reference":
            raise bad(
                f"{where}: item references are not taken here; send the item itself",
                f"{where}.type",
            )
        else:
            raise bad(
                f"{where}: {show(kind)} items are not supported; this server takes message, "
                "function_call, custom_tool_call, their outputs, and reasoning items",
                f"{where}.type",
            )
    return out


def _only(item: dict, keys: set[str], where: str) -> None:
    for k in item:
        if k not in keys:
            raise bad(f"{where}.{k} is not a field of a {item['type']} item", f"{where}.{k}")


def _message(item: dict, where: str) -> tuple[str, str]:
    _only(item, {"type", "id", "role", "content", "status", "phase"}, where)
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(
            f"{where}.role must be one of {', '.join(ROLES)}, got {show(role)}", f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return ROLES[role], content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None
        key = {"input_text": "text", "output_text": "text", "refusal": "refusal"}.get(kind)
        if key is None:
            raise bad(
                f"{at}: only text parts are supported"
                + (f" (got '{kind}')" if isinstance(kind, str) else ""),
                at,
            )
        if not isinstance(part.get(key), str):
            raise bad(f"{at}.{key} must be a string", f"{at}.{key}")
        texts.append(part[key])
    return ROLES[role], "\n".join(texts)


def _call(item: dict, where: str, written: bool = False) -> dict:
    _only(item, {"type", "id", "call_id", "name", "arguments", "status"}, where)
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise bad(f"{where} must be {{type: 'function_call', call_id, name, arguments}}", where)
    try:
        parsed = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        parsed = None
    if written and not isinstance(parsed, dict):
        parsed = args
    elif not isinstance(parsed, dict):
        raise bad(
            f"{where}.arguments must be a JSON object written as a string; send the "
            "arguments the model's call gave",
            f"{where}.arguments",
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def _custom_call(item: dict, where: str) -> dict:
    """A custom tool's call: its text as the one argument the template was offered."""
    _only(item, {"type", "id", "call_id", "name", "input", "status"}, where)
    call_id, name, text = item.get("call_id"), item.get("name"), item.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise bad(f"{where} must be {{type: 'custom_tool_call', call_id, name, input}}", where)
    if not isinstance(text, str):
        raise bad(f"{where}.input must be a string", f"{where}.input")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": {CUSTOM_INPUT: text}},
    }


def _call_output(item: dict, where: str) -> dict:
    _only(item, {"type", "id", "call_id", "output", "status"}, where)
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.call_id must be the call_id of the call it answers", where)
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            ok = isinstance(part, dict) and part.get("type") == "input_text"
            if not ok or not isinstance(part.get("text"), str):
                raise bad(f"{where}.output[{j}]: only input_text parts are supported", where)
            texts.append(part["text"])
        output = "\n".join(texts)
    if not isinstance(output, str):
        raise bad(f"{where}.output must be a string or a list of input_text parts", where)
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its ``content`` (the model's own words, as this server
    sends them), else its summary; an item with only encrypted content has none."""
    _only(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, where)
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise bad(f"{where}.{key} must be a list of {kind} parts", f"{where}.{key}")
        texts = [p.get("text") for p in parts if isinstance(p, dict)]
        if len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
            raise bad(f"{where}.{key} must be a list of {kind} parts", f"{where}.{key}")
        if texts:
            return "\n".join(texts)
    return ""


# -- answers ------------------------------------------------------------------------------
def usage(s: Stats | None, reasoning_tokens: int) -> dict:
    s = s or Stats()
    return {
        "input_tokens": s.prompt_tokens,
        "input_tokens_details": {"cached_tokens": s.prompt_tokens_cached},
        "output_tokens": s.generation_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": s.prompt_tokens + s.generation_tokens,
        "mlxkv": kv_figures(s),
    }


class Reply:
    """One answer as a Responses ``response``: output items built from the parts the
    answer arrives in, in the order the model wrote them; each call returns the stream
    events (``(name, data)``, numbered in order) that the parts make.

    A message item opens at the first text that is not whitespace (the blank lines a
    model writes after its reasoning or around a tool call make no item of their own).
    ``done`` is called with the finished response (to store it)."""

    def __init__(self, model: str, turn: Turn, done: Callable[[dict], None] | None = None):
        self.id = new_id("resp").replace("-", "_")
        self.model = model
        self.turn = turn
        self.done = done
        self.created = int(time.time())
        self.output: list[dict] = []
        self.open: str | None = None  # the type of the item still taking deltas
        self.blank = ""  # whitespace held until text follows it
        self.entries: list[dict] = []  # logprobs of text not yet written
        self.sequence = 0

    def head(self, status: str) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": None,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": self.output,
            "usage": None,
            **self.turn.request,
        }

    def start(self, stats: Stats) -> list[tuple[str, dict]]:
        snapshot = {**self.head("in_progress"), "output": []}
        return [self._event("response.created", response=snapshot), *self.running()]

    def queued(self) -> list[tuple[str, dict]]:
        """A background response's first events: created, and waiting for its turn."""
        snapshot = {**self.head("queued"), "output": []}
        return [
            self._event("response.created", response=snapshot),
            self._event("response.queued", response=snapshot),
        ]

    def running(self) -> list[tuple[str, dict]]:
        snapshot = {**self.head("in_progress"), "output": []}
        return [self._event("response.in_progress", response=snapshot)]

    def failed(self, response: dict) -> list[tuple[str, dict]]:
        """A background response's last event when it failed (``response`` as stored)."""
        return [self._event("response.failed", response=response)]

    def add(self, part: Part) -> list[tuple[str, dict]]:
        events = []
        if part.entry is not None and not (part.reasoning and not part.text):
            self.entries.append(part.entry)  # (a reasoning token's logprobs are not sent)
        if part.reasoning:
            events += self._write("reasoning", part.reasoning)
        if part.text:
            text, self.blank = self.blank + part.text, ""
            if self.open == "message" or text.strip():
                events += self._write("message", text)
            else:
                self.blank = text
        for call in part.calls:
            events += self._close("completed")
            events += self._call(call)
        return events

    def end(self, c: Choice) -> list[tuple[str, dict]]:
        incomplete = c.finish_reason in ("length", "context")
        events = self._close("incomplete" if incomplete else "completed")
        final = self.finish(c)
        name = "response.incomplete" if incomplete else "response.completed"
        return [*events, self._event(name, response=final)]

    def whole(self, c: Choice) -> dict:
        self._close("incomplete" if c.finish_reason in ("length", "context") else "completed")
        return self.finish(c)

    def fail(self, e: APIError) -> list[tuple[str, dict]]:
        return [self._event("error", code=e.code, message=e.message, param=e.param)]

    def snapshot(self, status: str) -> dict:
        """The response as a background one stands: queued, in progress (its output so far
        not shown), failed (``error`` set by the caller) or cancelled (the output so far)."""
        out = self.head(status)
        if status in ("queued", "in_progress", "failed"):
            out["output"] = []
        else:
            self._close("incomplete")
        return out

    def finish(self, c: Choice) -> dict:
        incomplete = c.finish_reason in ("length", "context")
        out = self.head("incomplete" if incomplete else "completed")
        out["completed_at"] = None if incomplete else int(time.time())
        # an answer that filled max_output_tokens or the model's context
        out["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        out["usage"] = usage(c.stats, c.reasoning_tokens)
        if self.done is not None:
            self.done(out)
        return out

    def _event(self, name: str, /, **data) -> tuple[str, dict]:
        self.sequence += 1
        return name, {"type": name, "sequence_number": self.sequence - 1, **data}

    def _write(self, kind: str, text: str) -> list[tuple[str, dict]]:
        events = []
        if self.open != kind:
            events += self._close("completed")
            events += self._start(kind)
        item = self.output[-1]
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
            return events
        entries, self.entries = self.entries, []
        part["logprobs"] += entries
        lp = [without_bytes(e) for e in entries]
        events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=lp))
        return events

    def _start(self, kind: str) -> list[tuple[str, dict]]:
        self.open = kind
        if kind == "reasoning":
            item = {"id": _item_id("reasoning"), "type": "reasoning", "summary": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _item_id("message"), "type": "message", "role": "assistant"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item.update(status="in_progress", content=[])
        self.output.append(item)
        where = {"output_index": len(self.output) - 1}
        added = self._event("response.output_item.added", **where, item=_copy(item))
        item["content"].append(part)
        opened = self._event(
            "response.content_part.added",
            item_id=item["id"],
            **where,
            content_index=0,
            part=_copy(part),
        )
        return [added, opened]

    def _close(self, status: str) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        item = self.output[-1]
        item["status"] = status
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        else:
            lp = [without_bytes(e) for e in part["logprobs"]]
            done = self._event("response.output_text.done", **where, text=part["text"], logprobs=lp)
        return [
            done,
            self._event("response.content_part.done", **where, part=_copy(part)),
            self._event(
                "response.output_item.done", output_index=where["output_index"], item=_copy(item)
            ),
        ]

    def _call(self, call: dict) -> list[tuple[str, dict]]:
        fn = call["function"]
        if fn["name"] in self.turn.custom:
            return self._custom_call(call["id"], fn["name"], _custom_input(fn["arguments"]))
        item = {
            "id": _item_id("function_call"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": "",
        }
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events = [
            self._event(
                "response.output_item.added", output_index=where["output_index"], item=_copy(item)
            ),
            self._event("response.function_call_arguments.delta", **where, delta=fn["arguments"]),
        ]
        item.update(arguments=fn["arguments"], status="completed")
        return [
            *events,
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=fn["name"],
                arguments=fn["arguments"],
            ),
            self._event(
                "response.output_item.done", output_index=where["output_index"], item=_copy(item)
            ),
        ]

    def _custom_call(self, call_id: str, name: str, text: str) -> list[tuple[str, dict]]:
        item = {
            "id": _item_id("custom_tool_call"),
            "type": "custom_tool_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            "input": "",
        }
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        added = self._event(
            "response.output_item.added", output_index=where["output_index"], item=_copy(item)
        )
        delta = self._event("response.custom_tool_call_input.delta", **where, delta=text)
        item.update(input=text, status="completed")
        return [
            added,
            delta,
            self._event("response.custom_tool_call_input.done", **where, input=text),
            self._event(
                "response.output_item.done", output_index=where["output_index"], item=_copy(item)
            ),
        ]


def _custom_input(arguments: str) -> str:
    """The text of a custom tool's call, from the arguments the model wrote for its one
    parameter (the text as written when they are not that)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    text = parsed.get(CUSTOM_INPUT) if isinstance(parsed, dict) else None
    return text if isinstance(text, str) else arguments


def _copy(obj: dict) -> dict:
    return json.loads(json.dumps(obj))


def stream_query(query: Mapping[str, str]) -> int | None:
    """``GET /v1/responses/{id}``'s ``stream`` and ``starting_after``: the sequence number
    after which to stream the response's events again (-1: from the first), or None to
    read the response whole."""
    stream = query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise bad(f"stream must be true or false, got {show(query['stream'])}", "stream")
    after = query.get("starting_after")
    if after is None:
        return -1 if stream == "true" else None
    if not after.isdigit() or not after.isascii():
        raise bad(
            f"starting_after must be the sequence number (0 or more) of the last event read, "
            f"got {show(after)}",
            "starting_after",
        )
    if stream != "true":
        raise bad("starting_after goes with stream=true", "starting_after")
    return int(after)


def count_body(n: int) -> dict:
    return {"object": "response.input_tokens", "input_tokens": n}


def not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"No response found with id '{response_id}': this server keeps the responses sent "
        "with store (the default) until they are deleted or pushed out by newer ones "
        f"({STORE_BYTES // 2**20} MiB are kept)",
        code="not_found",
    )
