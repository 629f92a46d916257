"""Render a model's chat template as untrusted code: sandboxed, and bounded in time and size.

A chat template comes from a model folder or a GGUF file, so anyone may have written it.
It is rendered the way transformers renders it (jinja2's ImmutableSandboxedEnvironment,
``raise_exception``, ``tojson``, ``strftime_now``, loop controls) with limits added:

* no loader: ``{% include %}`` / ``{% import %}`` reach no file;
* a time limit (a watchdog raises inside the rendering thread): loops end;
* a size limit on the output and on every string or list the template builds (``*``,
  ``+``, ``~``, ``%``, filters and method calls are checked before or right after they
  run), and integer arguments and powers are kept small;
* every failure (syntax, ``raise_exception``, a limit, a Python error) is one line.

:func:`install` puts the bounded renderer in place of the tokenizer's own
``apply_chat_template``, so every caller (chat, batch, TUI, server) goes through it;
:func:`use_template` puts a user's template file (``--chat-template``) in place of the
model's, rendered the same way, and gives every render default arguments
(``--chat-template-args``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from mlxkv.errors import UserError, first_line
from mlxkv.files import read_text

TIME_LIMIT = 10.0  # seconds; real templates take milliseconds, even for long chats
SIZE_LIMIT = 32 << 20  # characters of output, and of any string or list built on the way
INT_LIMIT = 100_000  # the largest integer passed to a filter or method (widths, counts)
_BIG_WIDTH = re.compile(r"\d{7,}")  # a format width of a million or more
FILE_LIMIT = 1 << 20  # bytes of a --chat-template file (models' own are 1-40 KB)
MODELS_OWN = "the model's chat template"


class TemplateLimit(Exception):
    """A chat template went over a limit (the message says which)."""


class _Timeout(BaseException):
    """Raised inside the rendering thread by the watchdog (a BaseException so that a
    template's own error handling cannot swallow it)."""


def _size(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple, dict)) else 0


def _check_size(x):
    if _size(x) > SIZE_LIMIT:
        raise TemplateLimit(f"it builds a value of {_size(x)} items (limit {SIZE_LIMIT})")
    return x


def _weight(x) -> int:
    """Characters and items that turning ``x`` into text would write, at least: a list
    holding one big list a thousand times weighs a thousand of it (it costs nothing to
    build, gigabytes to print). Stops counting past SIZE_LIMIT."""
    seen: dict[int, int] = {}  # a value met again weighs what it did (no recount)

    def weigh(v) -> int:
        if isinstance(v, (str, bytes)):
            return len(v)
        if not isinstance(v, (list, tuple, dict)):
            return 1
        if id(v) in seen:
            return seen[id(v)]
        total = len(v)
        for item in v.items() if isinstance(v, dict) else v:
            total += weigh(item)
            if total > SIZE_LIMIT:
                break
        seen[id(v)] = total
        return total

    try:
        return weigh(x)
    except RecursionError:
        raise TemplateLimit("it builds a value nested too deeply") from None


def _check_weight(x):
    """``x``, unless writing it out would go past SIZE_LIMIT."""
    if isinstance(x, (list, tuple, dict)) and _weight(x) > SIZE_LIMIT:
        raise TemplateLimit(f"it writes out a value of more than {SIZE_LIMIT} items")
    return x


# filters that read a value without writing it out or copying it
_CHEAP_FILTERS = {"length", "count", "first", "last", "default", "d", "int", "float", "abs"}


def _check_args(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > INT_LIMIT:
            raise TemplateLimit(f"it passes the number {a} (limit {INT_LIMIT})")


def _too_long(n: int) -> None:
    if n > SIZE_LIMIT:
        raise TemplateLimit(f"it builds a string longer than {SIZE_LIMIT}")


def _grows(name: str, value, args) -> None:
    """Refuse, before it runs, a string operation whose result would be too long."""
    if not isinstance(value, str):
        if name == "join" and isinstance(value, (list, tuple)):
            _too_long(sum(map(_size, value)) + len(value) * (len(str(args[0])) if args else 0))
        return
    if name == "replace" and len(args) >= 2 and isinstance(args[1], str):
        _too_long(len(value) + value.count(str(args[0])) * len(args[1]))
    elif name == "indent" and args and isinstance(args[0], int):
        _too_long(len(value) + (value.count("\n") + 1) * args[0])
    elif name in ("format", "format_map") and _BIG_WIDTH.search(value):
        raise TemplateLimit("it formats with a width of a million or more")


def _guard(name: str, f):
    """A filter or global that checks its arguments, and the size of its result."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # context/environment

    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
    def guarded(*args, **kwargs):
        _check_args(args[skip + 1 :], kwargs)
        if len(args) > skip:
            if name not in _CHEAP_FILTERS:  # tojson, string, sum, join ... write it out
                _check_weight(args[skip])
            _grows(name, args[skip], args[skip + 1 :])
        return _check_size(f(*args, **kwargs))

    return guarded


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # "a ~ b": joined, then measured
            self.write("environment.checked_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = _Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def checked_join(self, parts):
            if sum(_size(p) if isinstance(p, str) else 0 for p in parts) > SIZE_LIMIT:
                raise TemplateLimit(f"it builds a string longer than {SIZE_LIMIT}")
            for p in parts:
                _check_weight(p)
            return _check_size("".join(map(str, parts)))

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if _size(seq) and isinstance(n, int) and _size(seq) * n > SIZE_LIMIT:
                        raise TemplateLimit(f"it repeats a value {n} times")
                if isinstance(left, int) and isinstance(right, int):
                    if left.bit_length() + right.bit_length() > 4096:
                        raise TemplateLimit("it multiplies numbers too large")
            elif operator == "**" and isinstance(right, (int, float)):
                bits = left.bit_length() if isinstance(left, int) else 64
                if abs(right) > 1 << 16 or bits * abs(right) > 1 << 16:
                    raise TemplateLimit(f"it raises a number to the power {right}")
            elif operator == "+":
                if _size(left) + _size(right) > SIZE_LIMIT:
                    raise TemplateLimit(f"it builds a value longer than {SIZE_LIMIT}")
            elif operator == "%" and isinstance(left, str):
                if _BIG_WIDTH.search(left):
                    raise TemplateLimit("it formats with a width of a million or more")
                _check_weight(right)
            return _check_size(super().call_binop(context, operator, left, right))

        def getattr(self, obj, attribute):
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _grows("format", obj, ())
            return super().getattr(obj, attribute)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's names)
            _check_args(args, kwargs)
            method = getattr(__obj, "__wrapped__", __obj)  # jinja wraps str.format
            owner = getattr(method, "__self__", None)
            if isinstance(owner, str) and (args or kwargs):  # format, join: write arguments
                for a in (*args, *kwargs.values()):
                    _check_weight(a)
                name = getattr(method, "__name__", "")
                if name == "join":
                    args = (list(args[0]), *args[1:])
                    _grows("join", args[0], (owner,))
                else:
                    _grows(name, owner, args)
            return _check_size(super().call(__context, __obj, *args, **kwargs))

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = BoundedEnvironment(
        finalize=_check_weight,  # each {{ value }} before it is written out
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        loader=jinja2.DictLoader({}),  # include / import / extends find nothing
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=dict)
    env.filters = {k: _guard(k, f) for k, f in env.filters.items()}
    env.globals = {
        k: _guard(k, f) if inspect.isfunction(f) and k != "raise_exception" else f
        for k, f in env.globals.items()
    }
    return env


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    return _environment().from_string(source)


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise :class:`_Timeout` in this thread if the block runs longer than ``seconds``."""
    tid, lock, done, fired = threading.get_ident(), threading.Lock(), threading.Event(), []

    def watch():
        if not done.wait(seconds):
            with lock:
                if not done.is_set():
                    fired.append(True)
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(
                        ctypes.c_ulong(tid), ctypes.py_object(_Timeout)
                    )

    watcher = threading.Thread(target=watch, name="chat-template-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with lock:
            done.set()
            if fired:  # delivered already, or still pending: clear a pending one
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
        watcher.join()


def render(source: str, origin: str = MODELS_OWN, /, **variables) -> str:
    """``source`` (a chat template: ``origin`` names it in errors) rendered with
    ``variables``, within the limits; any failure is a one-line :class:`UserError`."""
    import jinja2

    why = None
    try:
        with _deadline(TIME_LIMIT):
            template = _compile(source)
            parts, total = [], 0
            for chunk in template.generate(**variables):
                total += len(chunk)
                if total > SIZE_LIMIT:
                    raise TemplateLimit(f"its output is longer than {SIZE_LIMIT} characters")
                parts.append(chunk)
            return "".join(parts)
    except _Timeout:
        why = f"it ran longer than {TIME_LIMIT:g} s"
    except TemplateLimit as e:
        why = str(e)
    except jinja2.TemplateSyntaxError as e:
        why = f"it does not parse (line {e.lineno}: {e.message})"
    except jinja2.TemplateNotFound as e:
        why = f"it includes {e.name!r}; a chat template may not read other files"
    except jinja2.TemplateError as e:
        why = first_line(e)
    except RecursionError:
        why = "it recurses too deeply"
    except MemoryError:
        why = "it needs more memory than there is"
    except Exception as e:  # a template is code: anything it raises is its own failure
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    raise UserError(f"{origin} failed: {why}")


def _template_source(tokenizer, chat_template=None) -> str:
    source = chat_template if chat_template is not None else tokenizer.chat_template
    if isinstance(source, dict):  # named templates: transformers picks "default"
        source = source.get("default")
    if not isinstance(source, str):
        raise UserError(
            "the model has no chat template; give a plain prompt with --raw, or use a chat model"
        )
    return source


# apply_chat_template's own options: for the tokenizer, not variables of the template
_TOKENIZE_OPTIONS = ("return_dict", "padding", "truncation", "max_length", "return_tensors",
                     "tokenizer_kwargs", "return_assistant_tokens_mask")  # fmt: skip


def open_final_message(text: str, conversation: list[dict]) -> str:
    """``text`` cut right after the last message's content, so that the answer goes on
    from it (a prefill): transformers' ``continue_final_message``, done the same way."""
    final = conversation[-1].get("content") if conversation else None
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise UserError(
            "the last message cannot be continued: the chat template does not show its "
            "text as written"
        )
    at = text.rindex(final.strip())
    kept = len(final.lstrip())
    # a template that keeps the message's trailing spaces keeps them; one that trims, not
    end = at + kept if text[at : at + kept] == final else at + len(final.strip())
    return text[:end]


def install(tokenizer) -> None:
    """Route ``tokenizer.apply_chat_template`` through :func:`render` (the HF tokenizer's
    own method is kept for the token ids, when a caller asks for them)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if getattr(hf.apply_chat_template, "mlxkv_bounded", False):
        return
    original = hf.apply_chat_template

    def apply_chat_template(
        conversation,
        tools=None,
        documents=None,
        chat_template=None,
        add_generation_prompt=False,
        tokenize=True,
        **kwargs,
    ):
        options = {k: kwargs.pop(k) for k in _TOKENIZE_OPTIONS if k in kwargs}
        continue_final = kwargs.pop("continue_final_message", False)
        special = {
            k: v for k, v in getattr(hf, "special_tokens_map", {}).items() if isinstance(v, str)
        }
        text = render(
            _template_source(hf, chat_template),
            MODELS_OWN if chat_template is not None else getattr(hf, "mlxkv_origin", MODELS_OWN),
            **{**special, **kwargs},
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
        if continue_final:
            text = open_final_message(text, conversation)
        if not tokenize:
            return text
        return original(
            conversation,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            continue_final_message=continue_final,
            **options,
            **kwargs,
        )

    apply_chat_template.mlxkv_bounded = True
    hf.apply_chat_template = apply_chat_template


# The arguments the renderer's callers set themselves: chat_template_kwargs (a request's)
# and --chat-template-args (the command line's) may not reach them.
RESERVED_ARGUMENTS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "chat_template", "tools",
    "documents", "tokenizer_kwargs",
})  # fmt: skip
ARGS_LIMIT = 64 << 10  # characters of --chat-template-args


@dataclass(frozen=True)
class ChatTemplate:
    """What the command line puts in place of the model's own template: a file's template
    (``source``, read from ``path``; None: the model's) and arguments every render gets
    unless its caller gives them (``args``)."""

    source: str | None = None
    path: str | None = None
    args: dict = field(default_factory=dict)


def read_template_file(path) -> ChatTemplate:
    """The chat template in the file ``path`` (``--chat-template``): UTF-8 text of at most
    a MiB that parses as a template; refused in one line otherwise."""
    import jinja2

    source = read_text(path, FILE_LIMIT, "--chat-template")
    why = None
    try:
        _compile(source)
    except jinja2.TemplateSyntaxError as e:
        why = f"line {e.lineno}: {e.message}"
    except RecursionError:
        why = "it nests too deeply"
    if why is not None:
        raise UserError(f"--chat-template {path} is not a Jinja template ({why}); fix or drop it")
    return ChatTemplate(source, str(path))


def parse_template_args(text: str) -> dict:
    """``--chat-template-args``: a JSON object of template arguments (``{"enable_thinking":
    false}``), none of them one the renderer's callers set; refused in one line otherwise."""
    example = """, e.g. '{"enable_thinking": false}'"""
    if len(text) > ARGS_LIMIT:
        raise UserError(f"--chat-template-args is longer than {ARGS_LIMIT} characters")
    try:
        args = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UserError(f"--chat-template-args is not JSON ({first_line(e)}){example}") from None
    if not isinstance(args, dict):
        raise UserError(f"--chat-template-args must be a JSON object{example}")
    for k in args:
        if k in RESERVED_ARGUMENTS:
            raise UserError(f"--chat-template-args: {k} is set by mlxkv itself; drop it")
    return args


def use_template(tokenizer, choice: ChatTemplate) -> None:
    """Render conversations as ``choice`` says: its file's template in place of the
    model's own (a Python renderer mlx-lm has for the model gives way too), and its
    arguments in every render whose caller does not give them."""
    if choice.source is not None:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        hf.chat_template = choice.source
        hf.mlxkv_origin = f"the chat template {Path(choice.path or '').name}"
        if getattr(tokenizer, "_chat_template", None) is not None:
            tokenizer._chat_template = None
        _read_tool_format(tokenizer, hf)
    if choice.args:
        render_with = tokenizer.apply_chat_template  # mlx-lm's: it adds enable_thinking
        defaults = dict(choice.args)

        def apply_chat_template(*a, **kwargs):
            return render_with(*a, **{**defaults, **kwargs})

        tokenizer.apply_chat_template = apply_chat_template


def _read_tool_format(tokenizer, hf) -> None:
    """The tool-call format read again from the new template as mlx-lm reads a model's:
    one that writes calls in a format mlx-lm knows lets a model call tools; one that shows
    none keeps the model's."""
    import importlib

    from mlx_lm.tokenizer_utils import _infer_tool_parser  # mlx-lm's rule (pinned version)

    kind = _infer_tool_parser(hf)
    if kind is None or not hasattr(tokenizer, "_tool_parser"):
        return
    tools = importlib.import_module(f"mlx_lm.tool_parsers.{kind}")
    if tokenizer._tool_parser is tools.parse_tool_call:
        return
    start, end = tools.tool_call_start, tools.tool_call_end
    tokenizer._tool_parser = tools.parse_tool_call
    tokenizer._tool_call_start, tokenizer._tool_call_end = start, end
    tokenizer._tool_call_start_tokens = tuple(hf.encode(start, add_special_tokens=False))
    tokenizer._tool_call_end_tokens = tuple(hf.encode(end, add_special_tokens=False))
