"""The loading screen: the model's name and source, each step as it happens (resolve /
download / convert / memory check / weights), a progress bar that fills as the weights
are read; on failure the error at once, plus a box to try another
model - never a traceback. Dismissed with None on success, or with the error on Esc."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Input, ProgressBar, Static

from tui.fmt import human_bytes
from tui.pipe import Progress, Status


class LoadingScreen(Screen):
    DEFAULT_CSS = """
    LoadingScreen { align: center middle; }
    LoadingScreen #box { width: 84; height: auto; border: round $accent; padding: 1 2; }
    LoadingScreen #title { text-style: bold; }
    LoadingScreen #source { color: $text-muted; margin-bottom: 1; }
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
        self.working = True  # a load is running (Esc waits for it)
        self.error: str | None = None

    def _title(self) -> str:
        return f"Loading {self.model or 'the default model'}"

    def compose(self) -> ComposeResult:
        with Vertical(id="box"):
            yield Static(self._title(), id="title", markup=False)
            yield Static("source: resolving ...", id="source", markup=False)
            yield ProgressBar(total=None, show_eta=False, id="bar")
            yield Static("", id="log", markup=False)
            yield Static("", id="error", markup=False)
            yield Input(placeholder="another model: name, folder, .gguf or repo id", id="retry")
            yield Static("Ctrl+Q quits", id="hint", markup=False)

    def show(self, item: Status | Progress) -> None:
        if isinstance(item, Progress):
            bar = self.query_one(ProgressBar)
            bar.update(total=max(item.total, 1), progress=item.done)
            self._log(f"weights {human_bytes(item.done)} of {human_bytes(item.total)}", True)
            return
        message = item.message
        if message.startswith("model "):  # "model PATH (SOURCE)" from the engine
            path, _, source = message[6:].partition(" (")
            if self.model is None:
                name = path.rstrip("/").rsplit("/", 1)[-1]
                self.query_one("#title", Static).update(f"Loading {name} (the default model)")
            source = source[:-1] if source.endswith(")") else source
            self.query_one("#source", Static).update(f"from {path}\n{source}")
            return
        self._log(message)

    def _log(self, line: str, replace_progress: bool = False) -> None:
        if replace_progress and self.lines and self.lines[-1].startswith("weights "):
            self.lines[-1] = line
        else:
            self.lines = (self.lines + [line])[-8:]
        self.query_one("#log", Static).update("\n".join(self.lines))

    def failed(self, message: str) -> None:
        self.working = False
        self.error = message
        self.query_one(ProgressBar).display = False
        self.query_one("#source", Static).display = False
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
        self.refresh(layout=True)  # the box grows: lay it out now, not at the next resize

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.working, self.error = True, None
        self.model = event.value.strip() or None
        self.query_one("#title", Static).update(self._title())
        source = self.query_one("#source", Static)
        source.update("source: resolving ...")
        source.display = True
        self.query_one("#error", Static).display = False
        self.query_one("#retry", Input).display = False
        bar = self.query_one(ProgressBar)
        bar.update(total=None, progress=0)
        bar.display = True
        self.lines = []
        self.query_one("#log", Static).update("")
        self.query_one("#hint", Static).update("Ctrl+Q quits")
        self.post_message(self.Retry(self.model))

    def action_back(self) -> None:
        if self.can_go_back and not self.working:
            self.dismiss(self.error)
