"""The conversation: message widgets in a scroll view that follows new text only while
the user is at the bottom (Textual's anchor is released when they scroll up)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

ROLE_LABEL = {"user": "you", "assistant": "assistant"}


class MessageView(Vertical, can_focus=True):
    """One message. Focus it (click/Tab) and press c to copy its text."""

    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 0 1 0; padding: 0 1; }
    MessageView.user { background: $boost; }
    MessageView:focus { background: $primary 15%; }
    MessageView .role { text-style: bold; color: $accent; }
    MessageView.user .role { color: $success; }
    MessageView .meta { color: $text-muted; }
    MessageView Markdown { margin: 0; padding: 0; }
    MessageView.evicted { opacity: 45%; }
    MessageView.evicted .role { color: $text-muted; }
    MessageView .gone { color: $warning; display: none; }
    MessageView.evicted .gone, MessageView.part-evicted .gone { display: block; }
    """
    BINDINGS = [("c", "copy", "Copy message")]

    def __init__(self, role: str, text: str = "", **kw):
        super().__init__(classes=role, **kw)
        self.role = role
        self.text = text
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Static(ROLE_LABEL.get(self.role, self.role), classes="role")
        yield Static("", classes="gone")
        if self.role == "user":  # as typed: code, line breaks and <tags> are no markup
            yield Static(self.text, markup=False, classes="typed")
        else:
            yield Markdown(self.text)
        yield Static("", classes="meta")

    @property
    def body(self) -> Markdown:
        return self.query_one(Markdown)

    async def append(self, delta: str) -> None:
        """Append streamed text: only the tail block of the document is re-parsed."""
        if not delta:
            return
        self.text += delta
        if self._stream is None:
            self._stream = Markdown.get_stream(self.body)
        await self._stream.write(delta)

    async def finish(self, text: str, meta: str = "") -> None:
        """End of the answer: render the final text once, in full (closes code blocks)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if text != self.text or not self.text:
            self.text = text
            await self.body.update(text or "*(no text)*")
        self.set_meta(meta)

    def set_evicted(self, share: float) -> None:
        """Dim the message by how much of it the KV cache has dropped (0 to 1)."""
        self.set_class(share >= 0.999, "evicted")
        self.set_class(0 < share < 0.999, "part-evicted")
        if share >= 0.999:
            text = "out of the KV window: the model no longer sees this message"
        else:
            text = f"{share:.0%} of this message is out of the KV window" if share else ""
        self.query_one(".gone", Static).update(text)

    def set_meta(self, meta: str) -> None:
        self.query_one(".meta", Static).update(meta)

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.app.notify("message copied to the clipboard", timeout=2)


class Note(Static):
    """A line from the app (errors, notices, help), not part of the conversation."""

    DEFAULT_CSS = """
    Note { margin: 0 0 1 0; padding: 0 1; color: $text-muted; }
    Note.error { color: $error; text-style: bold; }
    Note.notice { color: $warning; }
    """

    def __init__(self, text: str, kind: str = "info"):
        super().__init__(text, classes=kind, markup=False)


class ChatLog(VerticalScroll):
    DEFAULT_CSS = "ChatLog { height: 1fr; padding: 0 1; }"

    def on_mount(self) -> None:
        self.anchor()

    async def add(self, widget) -> None:
        await self.mount(widget)

    def messages(self) -> list[MessageView]:
        return list(self.query(MessageView))

    def last_message(self, role: str | None = None) -> MessageView | None:
        msgs = [m for m in self.messages() if role is None or m.role == role]
        return msgs[-1] if msgs else None
