"""Errors raised by cache operations (trim, save/load); messages are one line for the user."""

from mlxkv.errors import UserError


class CacheError(UserError, ValueError):
    """A cache operation that cannot be done as asked (rewind too far, wrong saved cache).
    A UserError, so the CLI prints it as one line, like PolicyError."""
