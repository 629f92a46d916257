"""The ``mlxkv top`` screen: polls ``GET /v1/status`` and draws :mod:`tui.top_view`'s text.
A poll that fails keeps the last figures on screen under a "disconnected, retrying" line."""

from __future__ import annotations

import httpx
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Header, Static

from tui import top_view
from tui.top_client import Unreachable, failure, headers, read_status


class TopApp(App):
    TITLE = "mlxkv top"
    CSS = """
    #top-body { padding: 0 1; }
    #top-body Static { margin-bottom: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    #top-body .title { text-style: bold; color: $accent; margin-bottom: 0; }
    #top-conn { height: 1; padding: 0 1; color: $text-muted; }
    #top-conn.lost { color: $error; text-style: bold; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
    ]

    def __init__(self, url: str, api_key: str | None, interval: float, first: dict):
        super().__init__()
        self.url = url
        self.api_key = api_key
        self.interval = interval
        self.status = first
        self.connected = True
        self._polling = False
        self._client: httpx.AsyncClient | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="top-body"):
            yield Static(id="top-head")
            yield Static(
                "Memory (admission: weights + runtime + reservations + prefixes)", classes="title"
            )
            yield Static(id="top-mem")
            yield Static(id="top-running")
            yield Static(id="top-queue")
            yield Static(id="top-cache")
            yield Static(id="top-totals")
        yield Static(id="top-conn")
        yield Footer()

    def on_mount(self) -> None:
        self._client = httpx.AsyncClient(headers=headers(self.api_key), timeout=self.interval + 5)
        self.draw()
        self.set_interval(self.interval, self.poll)

    async def on_unmount(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def poll(self) -> None:
        if self._polling or self._client is None:
            return
        self._polling = True
        try:
            response = await self._client.get(f"{self.url}/v1/status")
            self.status = read_status(response, self.url)
        except httpx.HTTPError as e:
            self.lost(failure(e, self.url))
        except Unreachable as e:
            self.lost(str(e))
        else:
            self.connected = True
            self.draw()
        finally:
            self._polling = False

    def lost(self, why: str) -> None:
        self.connected = False
        conn = self.query_one("#top-conn", Static)
        conn.update(f"disconnected, retrying every {self.interval:g} s: {why}")
        conn.set_class(True, "lost")

    def on_resize(self) -> None:
        self.draw()

    def draw(self) -> None:
        v = top_view.view(self.status)
        width = max(self.size.width - 4, 10)
        self.query_one("#top-head", Static).update(top_view.header(v, self.url))
        self.query_one("#top-mem", Static).update(top_view.memory_text(v, width))
        self.query_one("#top-running", Static).update(top_view.requests_text(v))
        self.query_one("#top-queue", Static).update(top_view.queue_text(v))
        self.query_one("#top-cache", Static).update(top_view.cache_text(v))
        self.query_one("#top-totals", Static).update(top_view.totals_text(v))
        if self.connected:
            conn = self.query_one("#top-conn", Static)
            conn.update(f"connected · every {self.interval:g} s · q quits")
            conn.set_class(False, "lost")
