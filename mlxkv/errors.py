"""Errors meant for the user: the CLI prints their message as one line, no traceback."""


class UserError(Exception):
    """Something the user asked for cannot be done; ``str(err)`` says what and what to do."""
