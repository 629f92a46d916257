"""The input box: Enter sends, Shift+Enter (or Ctrl+J, Alt+Enter) inserts a newline,
Up on the first line recalls earlier prompts, Down walks back."""

from __future__ import annotations

import time

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


class PromptInput(TextArea):
    DEFAULT_CSS = """
    PromptInput { height: auto; max-height: 8; min-height: 3; border: round $accent; }
    """

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, **kw)
        self.sent: list[str] = []
        self._recall: int | None = None  # index into history while browsing
        self._draft = ""
        self.key_latencies: list[float] = []  # seconds from key parse to handling

    async def _on_key(self, event: events.Key) -> None:
        self.key_latencies.append(time.monotonic() - event.time)
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            # emptied now, not when the app reads the message: keys typed right after Enter
            # are the next message's (the app gives the text back if it refuses it)
            text = self.text
            self.clear()
            self.post_message(self.Submitted(text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    def remember(self, text: str) -> None:
        if text.strip() and (not self.sent or self.sent[-1] != text):
            self.sent.append(text)
        self._recall = None

    def action_cursor_up(self, select: bool = False) -> None:
        if select or self.cursor_location[0] > 0 or not self.sent:
            return super().action_cursor_up(select)
        if self._recall is None:
            self._draft, self._recall = self.text, len(self.sent)
        self._recall = max(self._recall - 1, 0)
        self._show(self.sent[self._recall])

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if select or self._recall is None or self.cursor_location[0] < last_row:
            return super().action_cursor_down(select)
        self._recall += 1
        if self._recall >= len(self.sent):
            self._recall = None
            self._show(self._draft)
        else:
            self._show(self.sent[self._recall])

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)
