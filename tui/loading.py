"""The loading screen: steps as they happen (resolve / download / convert / load), and
on failure the error plus a box to try another model - never a traceback."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Input, ProgressBar, Static


class LoadingScreen(Screen):
    DEFAULT_CSS = """
    LoadingScreen { align: center middle; }
    LoadingScreen #box { width: 80; height: auto; border: round $accent; padding: 1 2; }
    LoadingScreen #title { text-style: bold; margin-bottom: 1; }
    LoadingScreen #log { color: $text-muted; margin-top: 1; }
    LoadingScreen #error { color: $error; text-style: bold; margin-top: 1; display: none; }
    LoadingScreen #retry { display: none; margin-top: 1; }
    LoadingScreen #hint { color: $text-muted; margin-top: 1; }
    """
    BINDINGS = [Binding("escape", "back", "Back to the chat")]

    class Retry(Message):
        def __init__(self, model: str | None):
            super().__init__()
            self.model = model

    def __init__(self, model: str | None, can_go_back: bool = False):
        super().__init__()
        self.model = model
        self.can_go_back = can_go_back
        self.lines: list[str] = []
        self.loading = True

    def compose(self) -> ComposeResult:
        with Vertical(id="box"):
            yield Static(f"Loading {self.model or 'the default model'}", id="title")
            with Center():
                yield ProgressBar(total=None, show_eta=False, show_percentage=False)
            yield Static("", id="log", markup=False)
            yield Static("", id="error", markup=False)
            yield Input(placeholder="another model: name, folder, .gguf or repo id", id="retry")
            yield Static("Ctrl+Q quits", id="hint")

    def status(self, message: str) -> None:
        self.lines = (self.lines + [message])[-8:]
        self.query_one("#log", Static).update("\n".join(self.lines))

    def failed(self, message: str) -> None:
        self.loading = False
        self.query_one(ProgressBar).display = False
        error = self.query_one("#error", Static)
        error.update(f"Could not load the model: {message}")
        error.display = True
        retry = self.query_one("#retry", Input)
        retry.display = True
        retry.focus()
        hint = "Enter loads the model typed above · Ctrl+Q quits"
        if self.can_go_back:
            hint += " · Esc goes back to the chat"
        self.query_one("#hint", Static).update(hint)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.loading = True
        self.model = event.value.strip() or None
        self.query_one("#title", Static).update(f"Loading {self.model or 'the default model'}")
        self.query_one("#error", Static).display = False
        self.query_one("#retry", Input).display = False
        self.query_one(ProgressBar).display = True
        self.lines = []
        self.post_message(self.Retry(self.model))

    def action_back(self) -> None:
        if self.can_go_back and not self.loading:
            self.dismiss()
