"""Driving the app headless with Textual's Pilot: wait until it is idle, send a message as
Enter does, settle it before a screenshot. Used by ``benchmarks/tui_screenshot.py`` and the
tests; the app itself does not import it."""

from __future__ import annotations

import time


def _panel_pending(app) -> bool:
    try:
        return app.panel._pending
    except Exception:  # no main screen yet
        return False


async def wait_idle(app, pilot, timeout: float = 30.0, step: float = 0.02) -> None:
    """Wait until no job runs and every queued event has been applied."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        await pilot.pause(step)
        if not (app.busy or app.handling or app.pipe._items or _panel_pending(app)):
            await pilot.pause()
            return
    raise TimeoutError(f"the app is still busy ({app.busy}) after {timeout} s")


async def wait_for(pilot, condition, timeout: float = 30.0, step: float = 0.02) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        await pilot.pause(step)
    raise TimeoutError("condition not met")


async def send(app, pilot, text: str, wait: bool = True, timeout: float = 30.0) -> None:
    """Put ``text`` in the input and submit it, as Enter does (posted directly: Pilot's key
    presses wait for the app to go idle, which a streaming answer delays). With
    ``wait=False`` it returns once the job has started."""
    from tui.prompt_input import PromptInput

    app.prompt.load_text(text)
    app.prompt.post_message(PromptInput.Submitted(text))
    if wait:
        await pilot.pause(0.05)
        await wait_idle(app, pilot, timeout)
    else:
        await wait_for(pilot, lambda: app.busy, timeout)


async def settle(pilot) -> None:
    """Before a snapshot: wait for idle, then repaint every widget from scratch, so the
    screenshot does not depend on which partial updates happened to come first."""
    app = pilot.app
    await wait_idle(app, pilot)
    app.clear_notifications()
    if app.screen is app.main:
        app.chat.scroll_end(animate=False, immediate=True)
    await pilot.pause(0.3)
    for widget in app.screen.walk_children(with_self=True):
        if hasattr(widget, "cursor_blink"):
            widget.cursor_blink = False  # a blinking cursor makes two different pictures
        widget.refresh(repaint=True, layout=True)
    await pilot.pause(0.05)
    await pilot.pause()
