"""Errors meant for the user: the CLI prints their message as one line, no traceback."""


class UserError(Exception):
    """Something the user asked for cannot be done; ``str(err)`` says what and what to do."""


def one_line(e: BaseException) -> str:
    """An exception as one line for a message: its type and the first line of its text."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
