"""Errors meant for the user: the CLI prints their message as one line, no traceback."""


class UserError(Exception):
    """Something the user asked for cannot be done; ``str(err)`` says what and what to do."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's text, or its type's name when it has none."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def one_line(e: BaseException) -> str:
    """An exception as one line for a message: its type and the first line of its text."""
    text = first_line(e)
    return text if text == type(e).__name__ else f"{type(e).__name__}: {text}"
