"""Pilot tests of the chat app over the scripted engine (tests/tui_fake.py): fast and
exact about what the UI does. The KV figures themselves are checked on the real engine
(tests/test_tui_model.py): the fake's are made up."""

from __future__ import annotations

import json
import stat

import pytest
from textual import events

from mlxkv.policy import KVPolicy
from tests.tui_pilot import fake_app, send, sync, wait_for, wait_idle
from tui.chat_view import MessageView, Note
from tui.conversations import ConversationStore
from tui.loading import LoadingScreen

SIZE = (120, 40)


def notes(app) -> list[str]:
    return [str(n.render()) for n in app.query(Note)]


def views(app) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in app.query(MessageView)]


@sync
async def test_send_streams_answer_and_panel():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        assert not isinstance(app.screen, LoadingScreen)
        await pilot.press(*"What is the capital of France?")
        await pilot.press("enter")
        await wait_idle(app, pilot)
        assert views(app) == [
            ("user", "What is the capital of France?"),
            ("assistant", "The capital of France is **Paris**."),
        ]
        assert app.prompt.text == ""
        assert app.panel.stats.generation_tokens == 6
        assert len(app.panel.series.points) >= 6  # one plot point per token
        # every engine call ran on the one MLX worker thread
        assert app.engine.owner == app.worker.ident


@sync
async def test_keys_typed_right_after_enter_are_kept():
    """The next message begun before the app has read this one (they were cleared with it)."""
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        app.prompt.load_text("hi")
        await app.prompt._on_key(events.Key("enter", None))  # the terminal's Enter
        app.prompt.insert("next")  # typed before the app reads the message
        await wait_idle(app, pilot)
        assert views(app)[0] == ("user", "hi")
        assert app.prompt.text == "next"


@sync
async def test_a_pasted_message_shows_as_typed():
    """Code, indentation, line breaks, <tags> and [links](x): the user's message is text, not
    Markdown (it ran together into one paragraph, the tags and link target gone)."""
    typed = "def f(x):\n    if x:\n        return 1\n<b>bold?</b> [link](http://x) # no heading"
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, typed)
        shown = app.chat.last_message("user").query_one(".typed")
        assert str(shown.render()) == typed


@sync
async def test_streaming_appends_and_panel_is_throttled():
    app = fake_app(delay=0.01)
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "tell me something", wait=False)
        view = app.chat.last_message("assistant")
        await wait_for(pilot, lambda: len(view.text) > 5)
        assert app.busy == "turn" and view._stream is not None  # appended, not re-rendered
        await wait_idle(app, pilot)
        assert view._stream is None and "```python" in view.text
        # a burst of token stats is drawn at most once now and once 1/MAX_HZ s later
        panel, before = app.panel, app.panel.renders
        for _ in range(100):
            panel.show(panel.stats)
        assert panel.renders - before <= 1 and panel._pending
        await pilot.pause(0.3)
        assert panel.renders - before <= 2 and not panel._pending


@sync
async def test_keypress_handled_while_streaming():
    app = fake_app(delay=0.3, max_tokens=10)  # 3 s of streaming: room for the key presses
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "tell me something", wait=False)
        await pilot.pause(0.1)
        await pilot.press("h", "i")
        assert app.busy == "turn" and app.prompt.text == "hi"
        await pilot.press("enter")  # refused while answering: the text stays
        assert app.prompt.text == "hi"
        await wait_idle(app, pilot)
        assert app.prompt.text == "hi"


@sync
async def test_escape_stops_generation():
    app = fake_app(delay=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "tell me something", wait=False)
        view = app.chat.last_message("assistant")
        await wait_for(pilot, lambda: len(view.text) > 5)
        await pilot.press("escape")
        await wait_idle(app, pilot)
        assert "stopped" in str(view.query_one(".meta").render())
        answer = app.engine.messages[-1]
        assert answer["role"] == "assistant" and 0 < len(answer["content"]) < 100
        assert answer["content"] == view.text
        await send(app, pilot, "What is the capital of France?")  # still usable
        assert "Paris" in app.chat.last_message("assistant").text


@sync
async def test_regenerate():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "What is the capital of France?")
        await pilot.press("ctrl+r")
        await wait_idle(app, pilot)
        assert [r for r, _ in views(app)] == ["user", "assistant"]
        assert [m["role"] for m in app.engine.messages] == ["user", "assistant"]
        assert len(app.engine.chat.generator.runs) == 2


@sync
async def test_policy_change_says_the_cost_first_and_bad_policies():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "/policy bits=4")  # nothing to re-read: applied at once
        assert app.engine.policy == KVPolicy(bits=4)
        await send(app, pilot, "What is the capital of France?")
        tokens = app.engine.reread_tokens()
        await send(app, pilot, "/policy window=64 sinks=4")
        # not applied yet: the cost is shown and the command waits in the input box
        assert app.engine.policy == KVPolicy(bits=4)
        assert (
            f"re-reads the conversation, {tokens} tokens (about 0 s at 100 tok/s)"
            in (notes(app)[-1])
        )
        assert app.prompt.text == "/policy window=64 sinks=4"
        await pilot.press("enter")
        await wait_idle(app, pilot)
        assert app.engine.policy == KVPolicy(window=64, sinks=4, bits=4)
        assert "sink 4 + window 64" in notes(app)[-1] and f"re-reads {tokens}" in notes(app)[-1]
        assert app.panel.stats.policy == app.engine.policy.describe()
        assert app.panel.stats.kv_tokens == 0  # the cache was dropped
        await send(app, pilot, "/policy window=64")  # the same policy: the cache stays
        assert "already" in notes(app)[-1] and app.prompt.text == ""
        await send(app, pilot, "/policy full")  # full means full precision too
        await pilot.press("enter")
        await wait_idle(app, pilot)
        assert app.engine.policy == KVPolicy()
        # a policy the (fake) model cannot honour: visible error, policy unchanged
        await send(app, pilot, "/policy window=8")
        await pilot.press("enter")
        await wait_idle(app, pilot)
        assert "policy unchanged" in notes(app)[-1] and app.engine.policy == KVPolicy()
        # an invalid one: error, and the command comes back selected, so what is typed
        # next replaces it instead of mixing with it
        app.prompt.clear()
        await send(app, pilot, "/policy bits=7")
        assert "not supported" in notes(app)[-1] and app.prompt.text == "/policy bits=7"
        assert app.prompt.selected_text == "/policy bits=7"
        await pilot.press(*"/help")
        assert app.prompt.text == "/help"


@sync
async def test_save_clear_load(tmp_path):
    app = fake_app()
    path = tmp_path / "chat.json"
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "/system be brief")
        await send(app, pilot, "What is the capital of France?")
        await send(app, pilot, f"/save {path}")
        await send(app, pilot, f"/save {tmp_path / 'chat.md'}")
        saved = json.loads(path.read_text())
        assert saved["system"] == "be brief" and len(saved["messages"]) == 2
        assert "Paris" in (tmp_path / "chat.md").read_text()
        before = path.read_bytes()
        await send(app, pilot, f"/save {path}")  # never overwrites a file
        assert "exists" in notes(app)[-1] and path.read_bytes() == before
        link = tmp_path / "link.json"  # a link to nothing: the save did create its target
        link.symlink_to(tmp_path / "elsewhere.json")
        await send(app, pilot, f"/save {link}")
        assert notes(app)[-1] == f"{link} exists; give a new file name (nothing was overwritten)"
        assert not (tmp_path / "elsewhere.json").exists()
        app.prompt.clear()
        await pilot.press("ctrl+l")
        await wait_idle(app, pilot)
        assert views(app) == [] and app.engine.messages == []
        await send(app, pilot, f"/load {path}")
        assert [r for r, _ in views(app)] == ["user", "assistant"]
        assert app.engine.system == "be brief"
        await send(app, pilot, f"/load {tmp_path / 'missing.json'}")
        assert "cannot load conversation" in notes(app)[-1]
        app.prompt.clear()
        await send(app, pilot, f"/load {tmp_path / 'chat.md'}")
        assert "is a Markdown export" in notes(app)[-1]
        assert len(app.engine.messages) == 2


@sync
async def test_empty_message_and_failure_keep_text():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "   ")
        assert views(app) == [] and app.engine.messages == []
        await send(app, pilot, "please !fail now")
        assert "failed mid-answer" in notes(app)[-1]
        assert app.prompt.text == "please !fail now"  # given back
        assert app.engine.messages == [] and [r for r, _ in views(app)] == []
        app.prompt.clear()
        await send(app, pilot, "What is the capital of France?")
        assert "Paris" in app.chat.last_message("assistant").text


@sync
async def test_unknown_model_at_start_then_retry():
    app = fake_app(model="no-such-model")
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        screen = app.screen
        assert isinstance(screen, LoadingScreen)
        assert "unknown model" in str(screen.query_one("#error").render())
        await pilot.press(*"fake-135m", "enter")
        await wait_idle(app, pilot)
        assert not isinstance(app.screen, LoadingScreen)
        assert app.engine.model_name == "fake-135m"


@sync
async def test_switch_model_failure_keeps_session():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "What is the capital of France?")
        await send(app, pilot, "/model no-such-model")
        assert isinstance(app.screen, LoadingScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, LoadingScreen)
        assert app.engine.model_name == "fake-135m" and len(app.engine.messages) == 2
        await send(app, pilot, "/model fake-135m")
        assert not isinstance(app.screen, LoadingScreen)
        assert "2 messages so far" in notes(app)[-1]


@sync
async def test_input_keys_history_and_newline():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "first")
        await send(app, pilot, "second")
        await pilot.press("up")
        assert app.prompt.text == "second"
        await pilot.press("up")
        assert app.prompt.text == "first"
        await pilot.press("down", "down")
        assert app.prompt.text == ""
        await pilot.press("a", "shift+enter", "b")
        assert app.prompt.text == "a\nb"
        await pilot.press("ctrl+j", "c")
        assert app.prompt.text == "a\nb\nc"


@pytest.mark.parametrize(
    "command,says",
    [("/help", "Esc"), ("/nonsense", "unknown"), ("/history", "not kept in this session")],
)
@sync
async def test_help_and_unknown_command(command, says):
    app = fake_app()  # no conversation store
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, command)
        assert says in notes(app)[-1]


@sync
async def test_ctrl_c_stops_an_answer_and_says_how_to_quit_when_idle():
    app = fake_app(delay=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await pilot.press("ctrl+c")  # idle: a hint, the app keeps running
        assert any("Ctrl+Q quits" in n.message for n in app._notifications)
        await send(app, pilot, "tell me something", wait=False)
        view = app.chat.last_message("assistant")
        await wait_for(pilot, lambda: len(view.text) > 5)
        await pilot.press("ctrl+c")
        await wait_idle(app, pilot)
        assert str(view.query_one(".meta").render()).startswith("stopped")
        assert app.is_running


@sync
async def test_ctrl_y_copies_while_the_input_has_focus():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "What is the capital of France?")
        assert app.focused is app.prompt
        await pilot.press("ctrl+y")
        assert app.clipboard == "The capital of France is **Paris**."


@sync
async def test_sampling_defaults_and_set():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        s = app.engine.settings  # the fake model has no generation_config.json
        assert (s.temperature, s.top_p, s.repetition_penalty) == (0.7, 0.9, 1.1)
        assert "temp 0.7 top-p 0.9 rep 1.1 max 200" in app.panel.sampling.plain
        await send(app, pilot, "/set temp 0.2 max_tokens 3")
        assert app.engine.chat.settings.temperature == 0.2
        assert "temp 0.2 top-p 0.9 rep 1.1 max 3" in app.panel.sampling.plain
        await send(app, pilot, "tell me something")
        assert app.panel.stats.generation_tokens == 3
        await send(app, pilot, "/set temp -1")
        assert notes(app)[-1] == "/set temp: give a number 0 or more (0 = greedy), got -1"
        assert app.engine.settings.temperature == 0.2
    greedy = fake_app(given={"temperature"})  # --temp 0 on the command line
    async with greedy.run_test(size=SIZE) as pilot:
        await wait_idle(greedy, pilot)
        assert greedy.engine.settings.temperature == 0.0
        assert "greedy" in greedy.panel.sampling.plain


@sync
async def test_conversations_are_kept_listed_and_reopened(tmp_path):
    store = ConversationStore(tmp_path)
    app = fake_app(store=store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "/policy window=64 sinks=4")
        await send(app, pilot, "What is the capital of France?")
        (first,) = tmp_path.glob("chat-*.json")
        kept = json.loads(first.read_text())
        assert kept["policy"]["window"] == 64 and kept["model"] == "fake-135m"
        assert [m["role"] for m in kept["messages"]] == ["user", "assistant"]
        await pilot.press("ctrl+l")
        await wait_idle(app, pilot)
        await send(app, pilot, "/policy full")
        await send(app, pilot, "Show me some code")
        assert len(list(tmp_path.glob("chat-*.json"))) == 2
        await send(app, pilot, "/history")
        listing = notes(app)[-1]
        assert "1. " in listing and "Show me some code (this one)" in listing
        assert "2. " in listing and "What is the capital of France?" in listing
        await send(app, pilot, "/history 2")
        assert views(app) == [(m["role"], m["content"]) for m in kept["messages"]]
        assert app.engine.policy == KVPolicy(window=64, sinks=4)
        await send(app, pilot, "And of Germany?")  # goes on in the reopened file
        assert len(json.loads(first.read_text())["messages"]) == 4
        await send(app, pilot, "/history 9")
        assert "give a number from 1 to 2" in notes(app)[-1]


@sync
async def test_resume_at_start(tmp_path):
    store = ConversationStore(tmp_path)
    saved = {
        "model": "fake-135m",
        "policy": {"window": 32, "sinks": 4, "bits": None, "group_size": 64},
        "system": "be brief",
        "sampling": {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.0, "max_tokens": 60},
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"},
        ],
    }
    path = store.save(saved)
    store.start()
    app = fake_app(store=store, resume=store.resume(path))
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        assert views(app) == [("user", "hello"), ("assistant", "hi there")]
        assert app.engine.system == "be brief" and app.engine.policy == KVPolicy(32, 4)
        s = app.engine.settings  # the sampling /set chose there (it came back as defaults)
        assert (s.temperature, s.top_p, s.repetition_penalty, s.max_tokens) == (0.6, 0.8, 1.0, 60)
        assert app.engine.sampling_source == "saved conversation"
        assert "resumed" in notes(app)[-1]
        await send(app, pilot, "What is the capital of France?")
        kept = json.loads(path.read_text())
        assert len(kept["messages"]) == 4 and kept["sampling"] == saved["sampling"]


@pytest.mark.parametrize(
    "sampling, problem",
    [
        ([0.6], "'sampling' must be an object, got list"),
        ({"temperature": "hot"}, "'sampling.temperature' must be a number, got 'hot'"),
        ({"max_tokens": 1.5}, "'sampling.max_tokens' must be a whole number, got 1.5"),
        ({"top_p": 2}, "'sampling' is not valid: --top-p must be in (0, 1], got 2"),
    ],
)
def test_a_saved_sampling_that_cannot_be_used_is_named(tmp_path, sampling, problem):
    from mlxkv.errors import UserError
    from tui.conversations import read_conversation

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"messages": [], "sampling": sampling}))
    with pytest.raises(UserError) as e:
        read_conversation(path)
    assert str(e.value) == f"cannot load conversation {path}: {problem}"


@sync
async def test_messages_out_of_the_window_are_dimmed():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "/policy window=16 sinks=4")
        await send(app, pilot, "What is the capital of France?")
        await send(app, pilot, "Show me some code " * 10)
        first, *_, last = app.chat.messages()
        assert first.has_class("evicted") and "no longer sees" in str(
            first.query_one(".gone").render()
        )
        assert not last.has_class("evicted")


@sync
async def test_failed_load_shows_at_once_and_esc_leaves_a_trace():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "/model /tmp/no-such-model")
        screen = app.screen
        assert isinstance(screen, LoadingScreen)
        error = screen.query_one("#error")
        assert error.display and error.region.height > 0  # laid out, not waiting for a resize
        assert "unknown model" in str(error.render())
        await pilot.press("escape")
        assert not isinstance(app.screen, LoadingScreen)
        assert "could not load the model" in notes(app)[-1] and "still using" in notes(app)[-1]


@sync
async def test_resume_of_20000_messages_shows_the_last_ones(tmp_path):
    store = ConversationStore(tmp_path)
    messages = [
        {"role": ("user", "assistant")[i % 2], "content": f"message {i}"} for i in range(20_000)
    ]
    path = store.save({"model": "fake-135m", "messages": messages})
    store.start()
    app = fake_app(store=store, resume=store.resume(path))
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot, timeout=120)
        shown = views(app)
        assert len(shown) == 50 and shown[-1] == ("assistant", "message 19999")
        assert shown[0] == ("user", "message 19950")
        assert any("19,950 earlier messages are in the conversation but not shown" in n
                   for n in notes(app))  # fmt: skip
        assert len(app.engine.messages) == 20_000
        await send(app, pilot, "/set temp nan")
        assert notes(app)[-1] == "/set temp: give a number 0 or more (0 = greedy), got nan"


@sync
async def test_a_resumed_conversation_made_read_only_is_kept_as_it_is(tmp_path):
    """It was replaced (and made writable, 0600) at the next answer."""
    store = ConversationStore(tmp_path)
    path = store.save({"model": "fake-135m", "messages": [{"role": "user", "content": "hi"}]})
    path.chmod(0o444)
    before = path.read_bytes()
    store.start()
    app = fake_app(store=store, resume=store.resume(path))
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "What is the capital of France?")
        assert views(app)[-1] == ("assistant", "The capital of France is **Paris**.")
        assert notes(app)[-1] == (
            f"could not keep the conversation: conversation {path} is read-only; make it "
            "writable (chmod u+w) or name another file"
        )
    assert path.read_bytes() == before and stat.S_IMODE(path.stat().st_mode) == 0o444


@sync
async def test_load_of_a_file_with_wrong_types_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}))
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, f"/load {bad}")
        assert notes(app)[-1] == (
            f"cannot load conversation {bad}: message 1 is not a {{role, content}} object "
            "with text content"
        )
        await send(app, pilot, "/load /dev/zero")
        assert notes(app)[-1] == (
            "cannot load conversation /dev/zero is not a regular file; name a regular file"
        )


@sync
async def test_panel_hides_on_a_narrow_terminal_and_f2_toggles_it():
    """Below 80 columns the chat keeps the width; F2 shows or hides the panel at any width."""
    app = fake_app()
    async with app.run_test(size=(70, 30)) as pilot:
        await wait_idle(app, pilot)
        chat = app.query_one("#chat-col")
        assert not app.panel.display and chat.size.width == 70
        await pilot.press("f2")
        await pilot.pause()
        assert app.panel.display and chat.size.width == 70 - app.panel.outer_size.width
        await pilot.press("f2")
        await pilot.pause()
        assert not app.panel.display and chat.size.width == 70
        await pilot.resize_terminal(120, 30)
        await pilot.pause()
        assert not app.panel.display  # hidden by the user: it stays hidden when wide
        await pilot.press("f2")
        await pilot.pause()
        assert app.panel.display and app.panel.outer_size.width == 46
    wide = fake_app()
    async with wide.run_test(size=SIZE) as pilot:
        await wait_idle(wide, pilot)
        assert wide.panel.display and wide.query_one("#chat-col").size.width == 120 - 46
