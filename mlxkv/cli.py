"""The front door: ``mlxkv chat | top | plan | generate | batch | serve | models | pull | bench``.

Subcommands from higher layers (the chat UI) register themselves as ``mlxkv.commands``
entry points in pyproject.toml, so this module never imports them by name.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import importlib
import os
import sys

from mlxkv import __version__
from mlxkv.backend import free_streams, setup_blas
from mlxkv.errors import UserError

# subcommand -> module with HELP, add_arguments(parser), run(args) -> int
COMMANDS = {
    "plan": "mlxkv.commands.plan",
    "generate": "mlxkv.commands.generate",
    "batch": "mlxkv.commands.batch",
    "serve": "mlxkv.commands.serve",
    "models": "mlxkv.commands.models",
    "pull": "mlxkv.commands.pull",
    "bench": "mlxkv.commands.bench",
}
ENTRY_POINT_GROUP = "mlxkv.commands"


def commands() -> dict[str, str]:
    """Installed subcommands (entry points) first, then the built-in ones."""
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return {**plugins, **COMMANDS}


DESCRIPTION = """\
Run chat models locally on MLX with bounded or compressed KV caches (sliding window,
attention sinks, quantized), check what a model will cost before loading it, and watch
the KV memory MLX holds next to the prediction."""


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose errors are one line, pointing at ``--help`` for the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="mlxkv", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"mlxkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in commands().items():
        module = importlib.import_module(module_name)
        help_text = getattr(module, "HELP", None)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def unknown_argument(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> str:
    """What was not understood, with the nearest option of the command (``--window`` ->
    ``--kv-window``, ``--max_tokens`` -> ``--max-tokens``, ``--temperature`` -> ``--temp``)."""
    import difflib

    options = [o for a in _subparser(parser, command)._actions for o in a.option_strings]
    flags = [x for x in extra if x.startswith("-")]
    if not flags and "--prompt" in options:  # `generate "Hello"`, or words left unquoted
        return f"unexpected argument {extra[0]!r}; give the prompt as --prompt 'TEXT' (quoted)"
    if not flags:
        return f"unexpected argument {extra[0]!r}; see 'mlxkv {command} --help'"
    flag = flags[0].split("=", 1)[0]
    # Names are compared without their dashes, which alone made --nonsense look like --seed;
    # an option the flag begins with is the nearest (--temperature -> --temp).
    names = {o.lstrip("-"): o for o in options if o.startswith("--")}
    name = flag.lstrip("-").replace("_", "-")
    begins = [n for n in names if len(n) >= 3 and name.startswith(n)]
    near = [max(begins, key=len)] if begins else difflib.get_close_matches(name, names, 1, 0.6)
    hint = f"did you mean {names[near[0]]}?" if near else f"see 'mlxkv {command} --help'"
    return f"unknown option {flag}; {hint}"


def undecodable_argument(parser: argparse.ArgumentParser, args) -> str | None:
    """The first argument holding bytes that are not UTF-8 (Python keeps them as lone
    surrogates, which no tokenizer, JSON or file name on macOS takes), named as written."""
    for action in _subparser(parser, args.command)._actions:
        values = getattr(args, action.dest, None)
        for value in values if isinstance(values, list | tuple) else [values]:
            text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
                continue
            except UnicodeEncodeError as e:
                bad = text[e.start]
            byte = ord(bad) - 0xDC00  # surrogateescape's stand-in for an undecodable byte
            what = f"the byte 0x{byte:02x}" if 0x80 <= byte <= 0xFF else ascii(bad)
            name = action.option_strings[0] if action.option_strings else action.metavar
            return f"{name or action.dest.upper()} is not UTF-8 text ({what}); write it in UTF-8"
    return None


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def entry() -> int:
    """The ``mlxkv`` console script and ``python -m mlxkv``: a command, with MLX's streams
    freed as the process exits (:func:`mlxkv.backend.free_streams`). Only here, not in
    :func:`main`, which tests call in a process that goes on using MLX."""
    atexit.register(free_streams)
    return main()


def main(argv: list[str] | None = None) -> int:
    try:
        setup_blas()  # before any command imports MLX
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
    except UserError as e:  # an environment variable (MLXKV_BLAS, MLXKV_MODELS, ...)
        print(f"mlxkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C while the BLAS or the commands load
        print("mlxkv: interrupted", file=sys.stderr)
        return 130
    if extra:
        print(
            f"mlxkv {args.command}: error: {unknown_argument(parser, args.command, extra)}",
            file=sys.stderr,
        )
        return 2
    if bad := undecodable_argument(parser, args):
        print(f"mlxkv {args.command}: error: {bad}", file=sys.stderr)
        return 2
    if args.command == "chat":
        from mlxkv.engine.distributed import launched

        if launched():
            # One terminal UI cannot be shared by N processes, and a split model needs every
            # rank to take each turn in lockstep: run chat on one machine.
            print(
                "mlxkv chat: error: chat runs in one process, not under mlx.launch; use "
                "'mlxkv generate' or 'mlxkv batch' across machines (docs/distributed.md)",
                file=sys.stderr,
            )
            return 2
    try:
        code = args.run(args)
        sys.stdout.flush()  # here, not at exit, so a failed write is reported below
        return code
    except UserError as e:
        print(f"mlxkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mlxkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return 0
    except RuntimeError as e:
        from mlxkv.engine.distributed import launched, lost_peer_message

        if not launched():
            raise
        # Under mlx.launch a rank that stops takes its sockets with it: say so in one line.
        print(f"mlxkv {args.command}: error: {lost_peer_message(e)}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:  # a path the user gave, past the system's limit
            name = os.fsdecode(e.filename or "")
            shown = f"{name[:40]}...{name[-20:]}" if len(name) > 64 else name
            print(
                f"mlxkv {args.command}: error: the file name {shown!r} is too long for this "
                "system; use a shorter one",
                file=sys.stderr,
            )
            return 2
        if e.errno == errno.EACCES and e.filename is not None:  # a folder it may not enter
            print(
                f"mlxkv {args.command}: error: {os.fsdecode(e.filename)}: permission denied; "
                "check its permissions (and its folders')",
                file=sys.stderr,
            )
            return 2
        if not _is_stdout_error(e):
            raise
        _drop_stdout()
        print(
            f"mlxkv {args.command}: error: cannot write the output: {e.strerror}", file=sys.stderr
        )
        return 1


def _is_stdout_error(e: OSError) -> bool:
    """A write to stdout failed (disk full, closed)? Other OS errors are bugs to see whole."""
    try:
        sys.stdout.flush()
    except OSError:
        return True
    return e.filename is None and e.errno in (errno.ENOSPC, errno.EIO, errno.EBADF, errno.EPIPE)


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
