"""Tool calling: the request's tools and tool messages checked, and the calls a model
writes into its answer found and turned into OpenAI ``tool_calls``.

A model calls a tool by writing its chat template's markers around the call
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` for Qwen and Hermes-style
templates); mlx-lm's tokenizer knows each family's markers and parser
(``tokenizer.has_tool_calling``, ``tool_call_start``, ``tool_call_end``, ``tool_parser``),
and this module uses them as they are.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxkv.server.errors import bad
from mlxkv.server.markers import pending

MAX_TOOLS = 128  # as OpenAI's API
ANY = "*"  # ToolUse.forced: a call of any tool (no function is named "*")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
JSON_CALLS = "mlx_lm.tool_parsers.json_tools"  # calls as {"name", "arguments"} JSON


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tool calling."""

    tools: list[dict] = field(default_factory=list)  # handed to the chat template
    parallel: bool = True  # False: at most one call per answer
    forced: str | None = None  # ANY: a call must come; a name: a call of that function
    # functions whose calls the model chooses to make are held to their schema (strict)
    strict: frozenset[str] = frozenset()

    @property
    def on(self) -> bool:
        return bool(self.tools)


def tool_list(tools, shape: str = "function tools") -> list:
    """A request's ``tools``: a list (none when absent) of at most MAX_TOOLS; ``shape`` is
    what the API's tools look like, for the message."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad(f"tools must be a list of {shape}", param="tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"tools holds {len(tools)} tools; at most {MAX_TOOLS}", param="tools")
    return tools


def check_tools(body: dict) -> ToolUse:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request.

    ``tool_choice`` "auto" (the default) lets the model decide; "none" renders the prompt
    without the tools, so the model answers in text; "required" or one named function
    forces a call (``forced_schema``), whose arguments then follow the schema. A call the
    model chooses to make follows it where ``strict`` is true (``call_schema``).
    """
    tools = tool_list(body.get("tools"))
    seen = set()
    for i, tool in enumerate(tools):
        _check_tool(tool, f"tools[{i}]", seen)
    forced = _forced(body.get("tool_choice"), seen)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if body.get("tool_choice") == "none":
        tools = []
    strict = frozenset(t["function"]["name"] for t in tools if t["function"].get("strict"))
    return ToolUse(tools=list(tools), parallel=parallel is not False, forced=forced, strict=strict)


def _forced(choice, names: set[str]) -> str | None:
    """``tool_choice``: "auto" and "none" force nothing; "required" forces a call of any
    tool, ``{"type": "function", "function": {"name": N}}`` a call of N."""
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        if not names:
            raise bad("tool_choice 'required' needs tools to call", param="tool_choice")
        return ANY
    fn = choice.get("function") if isinstance(choice, dict) else None
    named = isinstance(fn, dict) and choice.get("type") == "function"
    name = fn.get("name") if named else None
    if not isinstance(name, str):
        raise bad(
            "tool_choice must be 'auto', 'none', 'required' or {type: 'function', function: "
            f"{{name}}}}, got {json.dumps(choice)[:40]}",
            param="tool_choice",
        )
    if name not in names:
        raise bad(f"tool_choice names '{name}', which is not among the tools", "tool_choice")
    return name


def _check_tool(tool, where: str, seen: set[str]) -> None:
    """A chat request's tool: ``{type: "function", function: {...}}``."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad(
            f"{where} must be a function tool ({{type: 'function', function: {{name, "
            f"parameters}}}})" + (f"; '{kind}' tools are not supported" if kind else ""),
            param=f"{where}.type",
        )
    for k in tool:
        if k not in ("type", "function"):
            raise bad(f"{where}.{k} is not a field of a function tool", f"{where}.{k}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function must be an object with a name", f"{where}.function")
    for k in fn:
        if k not in _FUNCTION_KEYS:
            raise bad(
                f"{where}.function.{k} is not a field of a function; use "
                + ", ".join(sorted(_FUNCTION_KEYS)),
                f"{where}.function.{k}",
            )
    function_of(fn, f"{where}.function", seen, "parameters")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad(f"{where}.function.strict must be true or false", f"{where}.function.strict")


def function_of(tool: dict, where: str, seen: set[str], schema: str, longest: int = 64) -> dict:
    """One tool's name (unique among ``seen``, which it joins), description and parameter
    schema (the field ``schema``), checked, as the ``function`` a chat template reads."""
    name = tool.get("name")
    if not isinstance(name, str) or not re.fullmatch(rf"[A-Za-z0-9_-]{{1,{longest}}}", name):
        raise bad(
            f"{where}.name must be 1 to {longest} letters, digits, '_' or '-', got "
            f"{json.dumps(name)[:40]}",
            f"{where}.name",
        )
    if name in seen:
        raise bad(f"{where}: the name '{name}' is given twice", f"{where}.name")
    seen.add(name)
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise bad(f"{where}.description must be a string", f"{where}.description")
    parameters = tool.get(schema)
    if parameters is not None and not isinstance(parameters, dict):
        raise bad(f"{where}.{schema} must be a JSON Schema object", f"{where}.{schema}")
    fn = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return fn


def assistant_calls(calls, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's
    ``arguments`` (a JSON string in the API) decoded to an object."""
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise bad(f"{at} must be {{id, type: 'function', function: {{name, arguments}}}}", at)
        name, args = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise bad(f"{at}.function.name must be a non-empty string", f"{at}.function.name")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise bad(
                    f"{at}.function.arguments is not valid JSON; send the arguments the "
                    "model's call gave",
                    f"{at}.function.arguments",
                ) from None
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"{at}.id must be a string", f"{at}.id")
        entry = {"type": "function", "function": {"name": name, "arguments": args}}
        if call_id is not None:
            entry["id"] = call_id
        out.append(entry)
    return out


def call_schema(use: ToolUse) -> dict | None:
    """The JSON schema of one call ``{"name", "arguments"}`` the model chooses to make,
    written in its family's markers (the strict functions' arguments held to their
    parameters, the others' to any object); None when no function is strict."""
    if not use.on or not use.strict or use.forced:
        return None
    calls = []
    for tool in use.tools:
        fn = tool["function"]
        strict = fn["name"] in use.strict
        arguments = (fn.get("parameters") or {"type": "object"}) if strict else {"type": "object"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"anyOf": calls}


def forced_schema(use: ToolUse) -> dict:
    """The JSON schema a forced answer is held to: a list of calls ``{"name", "arguments"}``
    of the tools (of the named one), each's arguments its parameters' schema; one call
    when ``parallel_tool_calls`` is false or a function is named. The model writes it as
    JSON, not in its family's call markers, so this works for every template with tools
    (as vLLM forces calls)."""
    calls = []
    for tool in use.tools:
        fn = tool["function"]
        if use.forced not in (ANY, fn["name"]):
            continue
        arguments = fn.get("parameters") or {"type": "object"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not use.parallel or use.forced != ANY:
        schema["maxItems"] = 1
    return schema


class ForcedCallReader:
    """The reader of a forced answer (``forced_schema``): the whole text is the list of
    calls, read when the answer ends; text the grammar let through but that is no list of
    calls (an answer cut by max_tokens) is given back as content, as CallReader does."""

    def __init__(self):
        self.buf = ""
        self.calls: list[dict] = []
        self.unread: list[str] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        return "", []

    def close(self) -> tuple[str, list[dict]]:
        text, self.buf = self.buf, ""
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if not isinstance(items, list) or not items or not all(_is_call(c) for c in items):
            self.unread.append(text)
            return text, []
        for c in items:
            args = json.dumps(c["arguments"], ensure_ascii=False)
            call = {"index": len(self.calls), "id": new_call_id(), "type": "function"}
            call["function"] = {"name": c["name"], "arguments": args}
            self.calls.append(call)
        return "", list(self.calls)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class CallReader:
    """Splits one answer's text, as it streams, into content and tool calls.

    Text is released as soon as it cannot be the start of a call; the text of a call is
    held until its end marker, then parsed. A call the parser cannot read (a truncated or
    malformed one) is given back as the model wrote it, as content: nothing the model
    wrote is dropped, except the calls past the first with ``parallel_tool_calls: false``.
    """

    def __init__(
        self,
        start: str,
        end: str,
        parse: Callable[[str, list], object],
        tools: list[dict],
        parallel: bool = True,
    ):
        self.start, self.end = start, end
        self.parse = parse
        self.tools = tools
        self.parallel = parallel
        self.buf = ""
        self.inside = False
        self.seen = 0  # inside a call: how far the held text has no end marker
        self.calls: list[dict] = []  # every call found so far
        self.unread: list[str] = []  # calls the parser refused (for the server's log)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content that may be sent now and the calls that ``text`` completed."""
        self.buf += text
        out, calls = [], []
        while True:
            if not self.inside:
                i = self.buf.find(self.start)
                if i < 0:
                    keep = pending(self.buf, self.start)
                    out.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                out.append(self.buf[:i])
                self.buf = self.buf[i + len(self.start) :]
                self.inside, self.seen = True, 0
            elif not self.end:  # the call runs to the end of the answer (Mistral)
                break
            else:
                j = self.buf.find(self.end, self.seen)  # a long call is not searched again
                if j < 0:
                    self.seen = max(0, len(self.buf) - len(self.end) + 1)
                    break
                raw, self.buf = self.buf[:j], self.buf[j + len(self.end) :]
                self.inside = False
                found, text_back = self._read(raw, closed=True)
                calls += found
                out.append(text_back)
        return "".join(out), calls

    def close(self) -> tuple[str, list[dict]]:
        """At the answer's end: what is still held, as content or as a last call."""
        rest, self.buf = self.buf, ""
        if not self.inside:
            return rest, []
        self.inside = False
        found, text_back = self._read(rest, closed=not self.end)
        return text_back, found

    def _read(self, raw: str, closed: bool) -> tuple[list[dict], str]:
        written = self.start + raw + (self.end if closed else "")
        try:
            parsed = self.parse(raw, self.tools)
        except Exception:  # the parsers raise what they meet (ValueError, KeyError, ...)
            parsed = None
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items or not all(_is_call(c) for c in items):
            self.unread.append(written)
            return [], written
        calls = []
        for c in items:
            if not self.parallel and self.calls:
                break
            args = c["arguments"]
            call = {
                "index": len(self.calls),
                "id": c.get("id") or new_call_id(),
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": args
                    if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False),
                },
            }
            self.calls.append(call)
            calls.append(call)
        return calls, ""


def _is_call(c) -> bool:
    return isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c


def reader_for(tokenizer, use: ToolUse) -> CallReader | ForcedCallReader | None:
    """The reader of one answer of a request that offered tools (None: no tools)."""
    if not use.on:
        return None
    if use.forced:
        return ForcedCallReader()
    return CallReader(
        tokenizer.tool_call_start,
        tokenizer.tool_call_end or "",
        tokenizer.tool_parser,
        use.tools,
        use.parallel,
    )


def held_calls(use: ToolUse, tokenizer) -> str | None:
    """The grammar each call the model chooses to make is held to (``call_schema``), for a
    family that writes a call as JSON between its markers (mlx-lm's json_tools: Qwen,
    Hermes); None when no function is strict or the family writes calls otherwise."""
    from mlxkv.engine.grammar import call_grammar
    from mlxkv.errors import UserError

    schema = call_schema(use)
    parser = getattr(tokenizer, "tool_parser", None)
    if schema is None or getattr(parser, "__module__", "") != JSON_CALLS:
        return None
    try:
        return call_grammar(schema)
    except UserError as e:
        raise bad(str(e), "tools") from None


def has_tool_calling(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_tool_calling", False))
