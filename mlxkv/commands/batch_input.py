"""Reading a batch input file: JSONL lines -> jobs, or per-line errors that never stop the run.

A line is ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}`` with optional
``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``system``, ``json_schema``,
``min_tokens`` and ``ignore_eos``, or a
request line of OpenAI's Batch API (``custom_id``, ``method``, ``url``, ``body``), read as
the same fields. Only a file that cannot be a batch at all (missing, empty, not JSON on any
line) raises :class:`UserError`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from mlxkv.commands.batch_openai import embedding_ask, from_openai, is_openai
from mlxkv.engine.conversation import conversation_problem, plain_messages
from mlxkv.engine.grammar import json_grammar
from mlxkv.errors import UserError
from mlxkv.files import JSON_DEPTH, json_depth, read_bytes, read_stdin, utf8_problem

OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "system",
    "json_schema",
    "min_tokens",
    "ignore_eos",
)
MAX_STOP = 64  # stop strings of a line
KNOWN_FIELDS = ("id", "prompt", "messages", *OPTIONAL_FIELDS)
EMBEDDING_FIELDS = ("input", "dimensions")  # an embeddings line's, beside its id
INPUT_LIMIT = 1 << 30  # bytes of a whole input file (or stdin)
LINE_LIMIT = 64 << 20  # characters of one line


@dataclass
class Job:
    line: int  # 1-based line number in the input file
    id: str | int
    prompt: str | None = None
    messages: list[dict] | None = None
    system: str | None = None
    # GenerationSettings fields: max_tokens / temperature / top_p / seed / grammar
    overrides: dict = field(default_factory=dict)
    source: object = None  # the parsed line (what its fingerprint is taken of)
    embed: object = None  # an embeddings request line: its checked body (an EmbedAsk)


@dataclass
class BadLine:
    line: int
    error: str
    id: str | int | None = None
    source: object = None  # the parsed line, or its raw bytes when it is not JSON

    def record(self) -> dict:
        rec = {"id": self.id} if self.id is not None else {}
        return {**rec, "line": self.line, "error": self.error}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite JSON number (Python's json reads NaN and Infinity too)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_overrides(obj: dict) -> str | None:
    """Per-line sampling fields, checked here so the message names the field, not a flag."""
    if "max_tokens" in obj and not (_is_int(obj["max_tokens"]) and obj["max_tokens"] >= 1):
        return f"'max_tokens' must be an integer >= 1, got {obj['max_tokens']!r}"
    if "temperature" in obj and not (_is_number(obj["temperature"]) and obj["temperature"] >= 0):
        return f"'temperature' must be a number >= 0, got {obj['temperature']!r}"
    if "top_p" in obj and not (_is_number(obj["top_p"]) and 0 < obj["top_p"] <= 1):
        return f"'top_p' must be a number in (0, 1], got {obj['top_p']!r}"
    if "seed" in obj and not (_is_int(obj["seed"]) and 0 <= obj["seed"] < 2**64):
        return f"'seed' must be an integer in [0, 2**64), got {obj['seed']!r}"
    if "stop" in obj:
        stops = [obj["stop"]] if isinstance(obj["stop"], str) else obj["stop"]
        if not (isinstance(stops, list) and 0 < len(stops) <= MAX_STOP) or not all(
            isinstance(x, str) and x for x in stops
        ):
            return f"'stop' must be a string or a list of 1 to {MAX_STOP} strings, none empty"
    if "system" in obj and not isinstance(obj["system"], str):
        return "'system' must be a string"
    if "json_schema" in obj and not isinstance(obj["json_schema"], dict):
        return "'json_schema' must be a JSON Schema object ({} for any JSON value)"
    if "min_tokens" in obj and not (_is_int(obj["min_tokens"]) and obj["min_tokens"] >= 0):
        return f"'min_tokens' must be an integer >= 0, got {obj['min_tokens']!r}"
    if "ignore_eos" in obj and not isinstance(obj["ignore_eos"], bool):
        return f"'ignore_eos' must be true or false, got {obj['ignore_eos']!r}"
    held = [k for k in ("min_tokens", "ignore_eos") if obj.get(k)]
    if held and "json_schema" in obj:
        return f"'{held[0]}' cannot go with 'json_schema': that answer ends where its schema does"
    return None


def parse_line(n: int, raw: str | bytes) -> Job | BadLine:
    """One input line (``n`` is 1-based) -> a Job, or a BadLine saying what is wrong."""
    raw_bytes = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return BadLine(n, f"not UTF-8 text (byte {e.start} of the line)", None, raw_bytes)
    if len(raw) > LINE_LIMIT:
        return BadLine(
            n,
            f"the line is {len(raw):,} characters, more than the {LINE_LIMIT:,} a line may "
            "hold; shorten it",
            None,
            raw_bytes,
        )
    if json_depth(raw) > JSON_DEPTH:
        return BadLine(n, f"JSON nested deeper than {JSON_DEPTH} levels", None, raw_bytes)
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return BadLine(n, f"not valid JSON: {e}", None, raw_bytes)
    except RecursionError:
        return BadLine(n, "JSON nested too deeply", None, raw_bytes)
    if not isinstance(obj, dict):
        return BadLine(n, f"expected a JSON object, got {type(obj).__name__}", None, obj)
    source = obj  # what the line's fingerprint is taken of: the line as written
    key = "custom_id" if is_openai(obj) else "id"
    ident = obj.get(key)
    if key not in obj:
        return BadLine(n, "missing 'id'", None, obj)
    if not (isinstance(ident, str) or _is_int(ident)):
        return BadLine(n, f"'{key}' must be a string or an integer, got {ident!r}", None, obj)

    def bad(msg):
        return BadLine(n, msg, ident, source)

    if is_openai(source):
        obj = from_openai(obj)
        if isinstance(obj, str):
            return bad(obj)
        if "embed" in obj:
            return Job(n, ident, source=source, embed=obj["embed"])

    if "input" in obj:  # an embeddings line
        return _embedding_line(n, ident, obj, source)
    unknown = sorted(set(obj) - set(KNOWN_FIELDS))
    if unknown:
        return bad(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(KNOWN_FIELDS)}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        return bad("needs exactly one of 'prompt', 'messages' or 'input'")
    if has_prompt and not (isinstance(obj["prompt"], str) and obj["prompt"].strip()):
        return bad("'prompt' must be a non-empty string")
    if has_messages:  # OpenAI's forms of a message read as the plain ones
        obj = {**obj, "messages": plain_messages(obj["messages"])}
    if has_messages and (err := conversation_problem(obj["messages"])):
        return bad(f"'messages' {err}")
    if err := _check_overrides(obj):
        return bad(err)
    if bad_text := utf8_problem(obj):
        return bad(f"holds {bad_text}, a lone surrogate that is not valid text")
    named = ("max_tokens", "temperature", "top_p", "seed", "min_tokens", "ignore_eos")
    overrides = {k: obj[k] for k in named if k in obj}
    if "stop" in obj:  # a line's own stop strings replace --stop's
        overrides["stop"] = (obj["stop"],) if isinstance(obj["stop"], str) else tuple(obj["stop"])
    if "json_schema" in obj:  # the answer is held to it (constrained decoding)
        try:
            overrides["grammar"] = json_grammar(obj["json_schema"])
        except UserError as e:
            return bad(f"'json_schema': {e}")
    messages, system = obj.get("messages"), obj.get("system")
    return Job(n, ident, obj.get("prompt"), messages, system, overrides, source)


def _embedding_line(n: int, ident, obj: dict, source) -> Job | BadLine:
    """``{"id", "input", "dimensions"?}``: each input's embedding, the fields read as an
    OpenAI embeddings body's."""
    if extra := sorted(set(obj) - {"id", *EMBEDDING_FIELDS}):
        known = ", ".join(("id", *EMBEDDING_FIELDS))
        return BadLine(n, f"an 'input' line takes {known}; not {', '.join(extra)}", ident, source)
    ask = embedding_ask({k: obj[k] for k in EMBEDDING_FIELDS if k in obj})
    if isinstance(ask, str):
        return BadLine(n, ask, ident, source)
    return Job(n, ident, source=source, embed=ask)


def read_input(path: Path | str) -> list[Job | BadLine]:
    """Parse every non-blank line (``-`` reads stdin). A line that is not UTF-8 or not JSON
    becomes a BadLine; raises UserError only if the file cannot be a batch at all."""
    name = "stdin" if str(path) == "-" else str(path)
    if str(path) != "-":
        data = read_bytes(path, INPUT_LIMIT, "input file")
    else:
        data = read_stdin(
            INPUT_LIMIT, "the input", "stdin is closed; pipe the JSONL input into '-'"
        )
    # Lines end at b"\n" only: a JSON string may hold U+2028 or a lone \r. A byte-order
    # mark (Windows editors write one) is not part of the first line.
    lines = [raw.removesuffix(b"\r") for raw in data.removeprefix(b"\xef\xbb\xbf").split(b"\n")]
    entries = [parse_line(i, raw) for i, raw in enumerate(lines, 1) if raw.strip()]
    if not entries:
        raise UserError(f"input {name} is empty; expected one JSON object per line")
    if all(isinstance(e, BadLine) and isinstance(e.source, bytes) for e in entries):
        first = entries[0]
        raise UserError(
            f"input {name} is not JSONL: no line is JSON (line {first.line}: {first.error})"
        )
    return entries


def id_key(ident) -> tuple:
    """Ids compare with their JSON type: "1" and 1 are different ids."""
    return (type(ident).__name__, ident)


def find_duplicates(entries: list[Job | BadLine]) -> dict[int, int]:
    """Line number of each later occurrence of an id -> line of its first occurrence."""
    first: dict = {}
    dups: dict[int, int] = {}
    for e in entries:
        if e.id is not None:  # a bad line with an id still claims it
            key = id_key(e.id)
            if key in first:
                dups[e.line] = first[key]
            else:
                first[key] = e.line
    return dups
