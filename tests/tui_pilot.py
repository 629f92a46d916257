"""The app over the scripted engine for tests and measurements; the Pilot helpers (wait, send,
settle) are tui/pilot.py's, re-exported here."""

from __future__ import annotations

from tui.pilot import send, settle, wait_for, wait_idle

__all__ = ["fake_app", "send", "settle", "sync", "wait_for", "wait_idle"]

GIB = 1 << 30


def fake_app(
    delay: float = 0.0, model: str | None = None, max_tokens: int = 200, given=frozenset(), **kw
):
    """The real app over the scripted engine (tests/tui_fake.py), with a fixed memory budget so
    screenshots are the same on every machine."""
    from mlxkv.engine.session import GenerationSettings
    from tests.tui_fake import fake_opener
    from tui.app import ChatApp
    from tui.engine import ChatEngine

    engine = ChatEngine(
        fake_opener(delay=delay),
        GenerationSettings(max_tokens=max_tokens),
        budget=16 * GIB,
        given=given,
    )
    kw.setdefault("cursor_blink", False)
    return ChatApp(engine, model=model, **kw)


def sync(test):
    """Run an async test function with asyncio.run (no pytest async plugin needed)."""
    import asyncio
    import functools

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run
