"""The TUI's pure parts: plot, slash commands, number formatting, the event pipe."""

from __future__ import annotations

import pytest

from mlxkv.policy import KVPolicy, PolicyError
from tui import plot, slash
from tui.fmt import human_bytes, versus
from tui.pipe import EventPipe


def test_plot_size_and_colours():
    pts = [(i, i * 100, i * 100) for i in range(50)]
    text = plot.render(pts, 20, 4)
    lines = text.plain.split("\n")
    assert len(lines) == 4 and all(len(line) == 20 for line in lines)
    styles = {str(span.style) for span in text.spans}
    assert plot.BOTH in styles and plot.ACTUAL not in styles  # exact prediction: one colour


def test_plot_shows_disagreement():
    pts = [(i, i * 100, i * 50) for i in range(50)]
    styles = {str(span.style) for span in plot.render(pts, 20, 4).spans}
    assert plot.ACTUAL in styles and plot.PREDICTED in styles


def test_plot_plateau_reaches_top_row_and_stays():
    pts = [(i, min(i, 10) * 100, min(i, 10) * 100) for i in range(100)]
    top = plot.render(pts, 20, 4).plain.split("\n")[0]
    assert top[-1] != "⠀"  # the plateau is drawn along the top to the right edge


def test_plot_empty():
    assert len(plot.render([], 10, 3).plain.split("\n")) == 3


def test_series_is_bounded():
    s = plot.Series(limit=100)
    for i in range(1000):
        s.add(i, i, i)
    assert len(s.points) <= 101 and s.points[-1][0] == 999 and s.points[0][0] == 0


@pytest.mark.parametrize(
    "arg,current,expected",
    [
        ("full", KVPolicy(window=64, sinks=4), KVPolicy()),
        ("window=256", KVPolicy(), KVPolicy(window=256, sinks=4)),
        ("window=256 sinks=0", KVPolicy(), KVPolicy(window=256)),
        ("w=128 s=2 bits=4", KVPolicy(), KVPolicy(window=128, sinks=2, bits=4)),
        ("bits=8 group=32", KVPolicy(window=64, sinks=4), KVPolicy(64, 4, 8, 32)),
        ("bits=none", KVPolicy(bits=4), KVPolicy()),
        ("window=none", KVPolicy(window=64, sinks=4, bits=4), KVPolicy(bits=4)),
    ],
)
def test_parse_policy(arg, current, expected):
    assert slash.parse_policy(arg, current) == expected


@pytest.mark.parametrize("arg", ["", "bits=7", "window=abc", "colour=red", "window"])
def test_parse_policy_errors(arg):
    with pytest.raises(PolicyError):
        slash.parse_policy(arg, KVPolicy())


def test_parse_command():
    assert slash.parse("/policy bits=4") == slash.Command("/policy", "bits=4")
    assert slash.parse("  /CLEAR ") == slash.Command("/clear", "")
    assert slash.parse("//not a command") is None
    assert slash.parse("hello /x") is None
    assert "/policy" in slash.help_text() and "Esc" in slash.help_text()


def test_formatting():
    assert human_bytes(512) == "512 B"
    assert human_bytes(11796480) == "11.2 MiB"
    assert human_bytes(None) == "n/a"
    assert versus(100, 100) == "exact"
    assert versus(150, 100).startswith("actual +50 B")
    assert versus(100, None) == "no prediction"


def test_pipe_wakes_once_per_batch():
    wakes = []
    pipe = EventPipe(lambda: wakes.append(1))
    for i in range(5):
        pipe.put(i)
    assert wakes == [1] and pipe.drain() == [0, 1, 2, 3, 4]
    pipe.put(5)
    assert wakes == [1, 1] and pipe.drain() == [5] and pipe.drain() == []
