"""Pilot tests of the chat app over the scripted engine (tui.fake): fast and exact."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from mlxkv.policy import KVPolicy
from tui.chat_view import MessageView, Note
from tui.loading import LoadingScreen
from tui.panel import figures
from tui.testing import fake_app, send, sync, wait_for, wait_idle

SIZE = (120, 40)


def plain(renderable) -> str:
    console = Console(width=80)
    with console.capture() as out:
        console.print(renderable)
    return out.get()


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
        s = app.panel.stats
        assert s.kv_bytes_actual == s.kv_bytes_predicted > 0 and s.generation_tokens == 6
        assert "exact" in plain(figures(s))
        assert len(app.panel.series.points) >= 6  # one plot point per token
        # every engine call ran on the one MLX worker thread
        assert app.engine.threads == {app.worker.ident}


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
    app = fake_app(delay=0.3)
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
async def test_policy_change_and_bad_policies():
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, "What is the capital of France?")
        await send(app, pilot, "/policy window=64 sinks=4 bits=4")
        assert app.engine.policy == KVPolicy(window=64, sinks=4, bits=4)
        assert "sink 4 + window 64" in notes(app)[-1] and "dropped" in notes(app)[-1]
        assert app.panel.stats.policy == app.engine.policy.describe()
        assert app.panel.stats.kv_bytes_actual == 0  # the cache was dropped
        # a policy the (fake) model cannot honour: visible error, policy unchanged
        await send(app, pilot, "/policy window=8")
        assert "policy unchanged" in notes(app)[-1]
        assert app.engine.policy == KVPolicy(window=64, sinks=4, bits=4)
        # an invalid one: error, and the typed command stays in the box to fix
        await send(app, pilot, "/policy bits=7")
        assert "not supported" in notes(app)[-1] and app.prompt.text == "/policy bits=7"
        app.prompt.clear()
        await send(app, pilot, "tell me more " * 20)
        s = app.panel.stats
        assert s.kv_bytes_actual == s.kv_bytes_predicted and s.kv_evicted > 0


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
        await pilot.press("ctrl+l")
        await wait_idle(app, pilot)
        assert views(app) == [] and app.engine.messages == []
        await send(app, pilot, f"/load {path}")
        assert [r for r, _ in views(app)] == ["user", "assistant"]
        assert app.engine.system == "be brief"
        await send(app, pilot, f"/load {tmp_path / 'missing.json'}")
        assert "cannot load transcript" in notes(app)[-1]
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


@pytest.mark.parametrize("command", ["/help", "/nonsense"])
@sync
async def test_help_and_unknown_command(command):
    app = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_idle(app, pilot)
        await send(app, pilot, command)
        assert ("Esc" in notes(app)[-1]) if command == "/help" else "unknown" in notes(app)[-1]
