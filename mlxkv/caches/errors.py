"""Errors raised by cache operations (trim, save/load); messages are one line for the user."""


class CacheError(ValueError):
    """A cache operation that cannot be done as asked (rewind too far, wrong saved cache)."""
