"""The KV panel: what the cache holds (actual) next to what the memory model predicts.

Token events can arrive at 10-200 per second; the panel redraws at most ``MAX_HZ`` times
a second (the latest figures win) so drawing never competes with decoding for CPU.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Static

from mlxkv.engine.events import Stats
from tui import plot
from tui.fmt import human_bytes, tokens, versus

MAX_HZ = 5
BAR = "█"


def figures(s: Stats) -> Text:
    """Label, value, remark per line, in fixed columns (plain text keeps redraws cheap and
    screenshots stable)."""
    gap = versus(s.kv_bytes_actual, s.kv_bytes_predicted)
    rows = [
        ("actual", Text(human_bytes(s.kv_bytes_actual), plot.ACTUAL), "allocated"),
        ("predicted", Text(human_bytes(s.kv_bytes_predicted), plot.PREDICTED), "allocated"),
        ("", Text(""), Text(gap, "bold green" if gap == "exact" else "bold yellow")),
        ("logical", Text(human_bytes(s.kv_bytes_logical)), "kept tokens"),
        ("kept", Text(tokens(s.kv_tokens)), f"evicted {tokens(s.kv_evicted)}"),
        ("context", Text(tokens(s.kv_tokens_seen)), f"limit {tokens(s.context_limit)}"),
        ("prompt", Text(f"{s.prompt_tps:.1f} tok/s"), prompt_remark(s)),
        ("generate", Text(f"{s.generation_tps:.1f} tok/s"), f"{s.generation_tokens} tok"),
    ]
    out = Text(no_wrap=True, overflow="ellipsis")
    for n, (label, value, remark) in enumerate(rows):
        value.pad_left(max(12 - len(value), 0))
        out.append(f"{label:<9} ", "bold").append_text(value).append(" ")
        out.append_text(remark if isinstance(remark, Text) else Text(remark))
        if n < len(rows) - 1:
            out.append("\n")
    return out


def prompt_remark(s: Stats) -> str:
    """The turn's prompt tokens, and how many of them the cache already held (short: the
    panel is 43 columns wide)."""
    if s.prompt_tokens_cached:
        return f"{tokens(s.prompt_tokens_cached)}/{tokens(s.prompt_tokens)} cached"
    return f"{tokens(s.prompt_tokens)} tok"


def policy_line(s: Stats) -> Text:
    return Text.assemble(("policy ", "bold"), (s.policy, "bold yellow"))


def memory_bar(s: Stats, budget: int | None, width: int) -> Text:
    """weights | KV | rest of MLX's active memory, against the budget; ┃ marks the peak.
    A part that holds anything gets at least one cell, so a small KV cache stays visible."""
    scale = budget or max(s.peak_memory, s.active_memory, 1) * 5 // 4
    kv = s.kv_bytes_actual
    rest = max(s.active_memory - s.weights_bytes - kv, 0)
    width = max(width, 10)
    cells = []
    for size, style in ((s.weights_bytes, "blue"), (kv, "cyan"), (rest, "yellow")):
        cells += [style] * max(round(size / scale * width), 1 if size > 0 else 0)
    filled = min(len(cells), width)
    cells = cells[:width] + ["grey23"] * max(width - len(cells), 0)
    # The peak is at least what is held now: its mark goes after the parts, never over one.
    peak = min(width - 1, max(round(s.peak_memory / scale * width), filled))
    if s.peak_memory:
        cells[peak] = "peak"
    bar = Text(no_wrap=True)
    i = 0
    while i < width:  # one span per run of a colour
        j = i
        while j < width and cells[j] == cells[i]:
            j += 1
        char, style = ("┃", "bold red") if cells[i] == "peak" else (BAR, cells[i])
        bar.append(char * (j - i), style)
        i = j
    bar.append("\n")
    bar.append(f"weights {human_bytes(s.weights_bytes)} ", "blue")
    bar.append(f"KV {human_bytes(kv)} ", "bold cyan").append("rest ", "yellow")
    bar.append("peak┃", "bold red").append("\n")
    bar.append(f"active {human_bytes(s.active_memory)} · peak {human_bytes(s.peak_memory)}\n")
    bar.append(f"budget {human_bytes(budget) if budget else 'unknown'} (available at start)", "dim")
    return bar


class Figure(Widget):
    """Fixed-height text that redraws without a layout pass (Static.update reflows the
    whole screen; a panel that changes every token must not)."""

    DEFAULT_CSS = "Figure { height: auto; }"

    def __init__(self, height: int, **kw):
        super().__init__(**kw)
        self.styles.height = height
        self.content = Text("")

    def set(self, content) -> None:
        self.content = content
        self.refresh()

    def render(self):
        return self.content


class KVPanel(Vertical):
    DEFAULT_CSS = """
    KVPanel { width: 46; border-left: solid $primary; padding: 0 1; }
    KVPanel .title { text-style: bold; color: $accent; margin-top: 1; }
    KVPanel #kv-plot { height: 8; }
    """
    PLOT_HEIGHT = 8

    def __init__(self, **kw):
        super().__init__(**kw)
        self.stats = Stats()
        self.budget: int | None = None
        self.series = plot.Series()
        self.renders = 0  # redraw count (tests check the throttle)
        self._last = 0.0
        self._pending = False
        self.sampling = Text("")

    def compose(self) -> ComposeResult:
        yield Static("KV cache", classes="title")
        yield Figure(2, id="kv-policy")  # a quantized policy takes two lines
        yield Figure(1, id="kv-sampling")
        yield Figure(8, id="kv-figures")
        yield Static("Memory (MLX)", classes="title")
        yield Figure(4, id="kv-mem")
        yield Static(id="kv-plot-title", classes="title")
        yield Figure(self.PLOT_HEIGHT, id="kv-plot")

    def on_mount(self) -> None:
        title = Text("KV bytes / tokens  ")
        title.append("actual", plot.ACTUAL).append(" ").append("predicted", plot.PREDICTED)
        title.append(" ").append("both", plot.BOTH)
        self.query_one("#kv-plot-title", Static).update(title)
        self._redraw()

    def show(self, stats: Stats, point: bool = True) -> None:
        """Take new figures (and add them to the plot); redraw now or within 1/MAX_HZ s."""
        self.stats = stats
        if point:
            self.series.add(stats.kv_tokens_seen, stats.kv_bytes_actual, stats.kv_bytes_predicted)
        wait = 1 / MAX_HZ - (time.monotonic() - self._last)
        if wait <= 0:
            self._redraw()
        elif not self._pending:
            self._pending = True
            self.set_timer(wait, self._redraw)

    def show_sampling(self, settings, source: str) -> None:
        from tui.slash import describe_settings

        self.sampling = Text.assemble(("sample ", "bold"), describe_settings(settings))
        self.sampling.no_wrap, self.sampling.overflow = True, "ellipsis"
        self.sampling_source = source
        self._redraw()

    def reset_plot(self) -> None:
        self.series.clear()

    def on_resize(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        self._pending = False
        self._last = time.monotonic()
        self.renders += 1
        s = self.stats
        width = max(self.content_size.width, 20)
        self.query_one("#kv-policy", Figure).set(policy_line(s))
        self.query_one("#kv-sampling", Figure).set(self.sampling)
        self.query_one("#kv-figures", Figure).set(figures(s))
        self.query_one("#kv-mem", Figure).set(memory_bar(s, self.budget, width))
        pts = self.series.points
        graph = plot.render(pts, width, self.PLOT_HEIGHT - 1)
        x_max = pts[-1][0] if pts else 0
        y_max = max((max(p[1], p[2] or 0) for p in pts), default=0)
        graph.append(f"\n0-{x_max} tok, max {human_bytes(y_max)}", "dim")
        self.query_one("#kv-plot", Figure).set(graph)
