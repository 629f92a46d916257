"""The TUI's pure parts: plot, slash commands, number formatting, the event pipe, the
engine protocol, sampling defaults, kept conversations."""

from __future__ import annotations

import inspect
import json
import stat

import pytest

from mlxkv.engine.events import Stats
from mlxkv.engine.sampling import chat_sampling
from mlxkv.engine.session import GenerationSettings
from mlxkv.errors import UserError
from mlxkv.policy import KVPolicy, PolicyError
from tui import plot, slash
from tui.conversations import ConversationStore, read_conversation
from tui.engine import ChatGenerator
from tui.fmt import human_bytes, versus
from tui.panel import figures, memory_bar
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
        ("full", KVPolicy(window=64, sinks=4, bits=4), KVPolicy()),  # full precision too
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


@pytest.mark.parametrize(
    "arg",
    ["", "bits=7", "window=abc", "colour=red", "window", "window=99999999999999999999999"],
)
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


def _members(proto) -> list[str]:
    return [n for n in vars(proto) if not n.startswith("_")] + list(proto.__annotations__)


@pytest.mark.parametrize("member", _members(ChatGenerator))
def test_fake_and_real_generator_share_the_protocol(member):
    """The scripted generator the UI tests use has every member of ChatGenerator that the
    real Session has, with the same parameters: a UI test cannot pass against an
    interface the engine does not have."""
    from mlxkv.engine.session import Session
    from tests.tui_fake import FakeGenerator

    if member in ChatGenerator.__annotations__:  # a data attribute
        assert member in Session.__dataclass_fields__
        assert hasattr(FakeGenerator(), member)
        return
    want = list(inspect.signature(getattr(ChatGenerator, member)).parameters)
    for cls in (Session, FakeGenerator):
        assert callable(getattr(cls, member, None)), f"{cls.__name__} lacks {member}()"
        assert list(inspect.signature(getattr(cls, member)).parameters) == want, (cls, member)


def test_parse_set():
    assert slash.parse_set("temp 0.2") == {"temperature": 0.2}
    assert slash.parse_set("top_p=0.5 max_tokens 64") == {"top_p": 0.5, "max_tokens": 64}
    for bad in ("", "temp", "colour 3", "max_tokens 1.5"):
        with pytest.raises(UserError):
            slash.parse_set(bad)


@pytest.mark.parametrize(
    "arg, message",
    [
        ("temp nan", "/set temp: give a number 0 or more (0 = greedy), got nan"),
        ("temp inf", "/set temp: give a number 0 or more (0 = greedy), got inf"),
        ("temp 0.7 temp -1", "/set temp: give a number 0 or more (0 = greedy), got -1"),
        ("rep -3", "/set rep: give a number above 0 (1 = none), got -3"),
        ("rep nan", "/set rep: give a number above 0 (1 = none), got nan"),
        ("top_p 0", "/set top_p: give a number above 0 and at most 1, got 0"),
        ("top_p 1.5", "/set top_p: give a number above 0 and at most 1, got 1.5"),
        ("max_tokens 0", "/set max_tokens: give a whole number 1 or more, got 0"),
    ],
)
def test_parse_set_refuses_values_sampling_cannot_use(arg, message):
    with pytest.raises(UserError) as e:
        slash.parse_set(arg)
    assert str(e.value) == message


def test_sampling_defaults(tmp_path):
    base = GenerationSettings()
    s, source = chat_sampling(base, set(), tmp_path)  # no generation_config.json
    assert (s.temperature, s.top_p, s.repetition_penalty) == (0.7, 0.9, 1.1)
    assert source == "mlxkv defaults"
    greedy, _ = chat_sampling(base, {"temperature"}, tmp_path)  # --temp 0 stays greedy
    assert greedy.temperature == 0.0 and greedy.top_p == 0.9
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    s, source = chat_sampling(base, set(), tmp_path)
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    assert source == "generation_config.json"


def test_memory_bar_shows_a_small_kv_cache():
    s = Stats(kv_bytes_actual=1 << 20, weights_bytes=500 << 20, active_memory=520 << 20)
    bar = memory_bar(s, budget=16 << 30, width=40)  # 1 MiB of 16 GiB: under half a cell
    first = bar.plain.split("\n")
    cyan = [span for span in bar.spans if str(span.style) == "cyan"]
    assert cyan and cyan[0].end - cyan[0].start == 1  # one visible cell
    assert "KV 1.0 MiB" in first[1]


def test_conversation_store(tmp_path):
    store = ConversationStore(tmp_path)
    assert store.save({"messages": []}) is None and store.list() == []
    data = {"model": "m", "policy": {"window": 64, "sinks": 4}, "system": "", "messages": []}
    data["messages"] = [{"role": "user", "content": "hello there"}]
    path = store.save(data)
    data["messages"].append({"role": "assistant", "content": "hi"})
    assert store.save(data) == path  # the same file, rewritten whole
    assert json.loads(path.read_text())["messages"][-1]["content"] == "hi"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    (saved,) = store.list()
    assert (saved.messages, saved.policy, saved.title) == (2, "sink 4 + window 64", "hello there")
    assert store.last() == path
    store.start()
    other = store.save({**data, "messages": data["messages"][:1]})
    assert other != path and len(store.list()) == 2
    assert stat.S_IMODE(other.stat().st_mode) == 0o600  # a conversation is private


def test_markdown_export_is_not_a_conversation(tmp_path):
    md = tmp_path / "chat.md"
    md.write_text("# Chat with x\n")
    with pytest.raises(UserError, match="Markdown export"):
        read_conversation(md)
    renamed = tmp_path / "chat.txt"
    renamed.write_text("# Chat with x\n")
    with pytest.raises(UserError, match="Markdown export"):
        read_conversation(renamed)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(UserError, match="not a conversation file"):
        read_conversation(bad)


def test_chat_is_an_entry_point_not_an_import():
    """mlxkv/ never imports tui/: the chat subcommand comes from pyproject.toml."""
    from mlxkv import cli

    assert cli.commands()["chat"] == "tui.command"
    assert "chat" not in cli.COMMANDS


def test_panel_says_how_much_of_the_prompt_the_cache_held():
    fresh = figures(Stats(prompt_tokens=1107, prompt_tps=50.0)).plain
    assert "1,107 tok" in fresh and "cached" not in fresh
    again = figures(Stats(prompt_tokens=1107, prompt_tokens_cached=1106, prompt_tps=50.0)).plain
    assert "1,106/1,107 cached" in again
    assert max(len(line) for line in again.splitlines()) <= 43  # the panel's inner width


def test_evicted_shares_stop_past_the_spans_limit():
    """Measuring each message's tokens renders the template once per message: past
    SPANS_LIMIT messages the chat does not dim (None) rather than stall after each turn."""
    from dataclasses import replace

    from tests.tui_fake import fake_opener
    from tui.engine import SPANS_LIMIT, ChatEngine

    engine = ChatEngine(fake_opener(), GenerationSettings(), policy=KVPolicy(window=32, sinks=4))
    engine.open(None, on_status=lambda _m: None)
    rendered = []
    tokenizer = engine.chat.generator.loaded.tokenizer
    apply = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda m, **kw: (rendered.append(len(m)), apply(m, **kw))[1]
    stats = replace(engine.idle_stats(), kv_evicted=10)
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"m{i}"} for i in range(20)]
    engine.chat.messages = turns[:]
    shares = engine.evicted(stats)
    assert len(shares) == 20 and max(shares) == 1.0 and shares[-1] == 0.0
    rendered.clear()
    engine.chat.messages = turns * (SPANS_LIMIT // 20 + 1)
    assert engine.evicted(stats) is None and rendered == []
