"""A two-series braille plot (KV bytes over tokens: actual and predicted).

Each terminal cell holds 2x4 braille dots, so a 40x6 panel gives an 80x24 dot grid:
enough to see the slope of a full cache and the plateau of a window at a glance.
Cells where both series fall are drawn in the 'both' colour: with an exact prediction
the whole line is that colour, and any disagreement shows up as two colours.
"""

from __future__ import annotations

from rich.text import Text

# Braille dot bits by (x, y) inside a cell, y counted from the top.
_DOTS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))
ACTUAL, PREDICTED, BOTH, MIXED = "bold cyan", "magenta", "bold green", "yellow"


class Series:
    """Points (x, actual, predicted) with a bounded memory: halves itself when full."""

    def __init__(self, limit: int = 2048):
        self.limit = limit
        self.points: list[tuple[int, int, int | None]] = []

    def add(self, x: int, actual: int, predicted: int | None) -> None:
        if self.points and self.points[-1][0] == x:
            self.points[-1] = (x, actual, predicted)
            return
        self.points.append((x, actual, predicted))
        if len(self.points) > self.limit:
            last = self.points[-1]
            self.points = self.points[::2]
            if self.points[-1] != last:
                self.points.append(last)

    def clear(self) -> None:
        self.points.clear()


def _columns(points, width_dots: int, x_max: int, pick) -> list[int | None]:
    """Largest value per dot column (None where no point falls)."""
    cols: list[int | None] = [None] * width_dots
    for x, *values in points:
        v = pick(values)
        if v is None:
            continue
        c = min(width_dots - 1, int(x * width_dots / (x_max + 1)))
        cols[c] = v if cols[c] is None else max(cols[c], v)
    # Carry the last value forward so a sparse series still reads as a line.
    end = max((i for i, v in enumerate(cols) if v is not None), default=-1)
    last = None
    for i in range(end + 1):
        if cols[i] is None:
            cols[i] = last
        last = cols[i]
    return cols


def _grid(cols: list[int | None], rows: int, y_max: int) -> set[tuple[int, int]]:
    dots, prev = set(), None
    for x, v in enumerate(cols):
        if v is None:
            prev = None
            continue
        y = rows - 1 - round(v / y_max * (rows - 1)) if y_max else rows - 1
        lo, hi = (y, y) if prev is None else (min(prev, y), max(prev, y))
        for yy in range(lo, hi + 1):  # join steps vertically so jumps stay visible
            dots.add((x, yy))
        prev = y
    return dots


def render(points, width: int, height: int) -> Text:
    """Plot ``points`` [(tokens, actual_bytes, predicted_bytes)] in ``width`` x ``height``
    cells; an empty plot is a flat baseline. Cells of one colour are appended as one run
    (one style span per run keeps Textual's per-span work small)."""
    width, height = max(width, 2), max(height, 1)
    wd, hd = width * 2, height * 4
    x_max = max((p[0] for p in points), default=0)
    y_max = max((max(p[1], p[2] or 0) for p in points), default=0)
    masks = []
    for pick in (lambda v: v[0], lambda v: v[1]):
        cells = [[0] * width for _ in range(height)]
        for x, y in _grid(_columns(points, wd, x_max, pick), hd, y_max):
            cells[y // 4][x // 2] |= _DOTS[y % 4][x % 2]
        masks.append(cells)
    text = Text(no_wrap=True, overflow="crop")
    for row in range(height):
        run, run_style = [], None
        for col in range(width):
            bits_a, bits_p = masks[0][row][col], masks[1][row][col]
            bits = bits_a | bits_p
            if not bits:
                char, style = ("⠀" if row < height - 1 else "⣀"), "dim"
            else:
                char = chr(0x2800 + bits)
                if bits_a == bits_p:
                    style = BOTH
                else:
                    style = MIXED if bits_a and bits_p else ACTUAL if bits_a else PREDICTED
            if style != run_style and run:
                text.append("".join(run), run_style)
                run = []
            run.append(char)
            run_style = style
        text.append("".join(run), run_style)
        if row < height - 1:
            text.append("\n")
    return text
