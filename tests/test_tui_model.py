"""The chat app over the real engine and the offline default model (SmolLM2-135M)."""

from __future__ import annotations

import json

import pytest

from mlxkv.cli import build_parser
from mlxkv.engine.events import Finished, PrefillProgress
from mlxkv.engine.session import GenerationSettings
from mlxkv.policy import KVPolicy
from tests.tui_pilot import send, sync, wait_for, wait_idle
from tui.app import ChatApp
from tui.chat_view import MessageView, Note
from tui.command import PREFILL_STEP, build_app
from tui.engine import ChatEngine, real_opener

# The app opens the model through mlxkv.engine.loading.open_model on its worker thread;
# ``preloaded`` hands it the session's loaded default model (a load per app otherwise).
pytestmark = pytest.mark.model
GREEDY = {"temperature", "top_p", "repetition_penalty"}  # as if given on the command line


@sync
async def test_real_model_streams_and_panel_matches_under_three_policies(
    default_model_path, preloaded
):
    engine = ChatEngine(real_opener(), GenerationSettings(max_tokens=24), given=GREEDY)
    app = ChatApp(engine, model=str(default_model_path))
    async with app.run_test(size=(130, 40)) as pilot:
        await wait_idle(app, pilot, timeout=300)
        assert app.engine.loaded, "the default model did not load"
        turns = [
            (None, "What is the capital of France?", "Paris"),
            ("window=32 sinks=4", "And of Germany?", "Berlin"),
            ("full bits=4", "And of Italy?", "Rome"),
        ]
        for policy, question, expected in turns:
            if policy:
                await send(app, pilot, f"/policy {policy}", timeout=120)  # says the cost
                assert "re-reads the conversation" in str(app.query(Note).last().render())
                await send(app, pilot, f"/policy {policy}", timeout=120)  # applies it
            await send(app, pilot, question, wait=False, timeout=120)
            view = app.chat.last_message("assistant")
            await wait_for(pilot, lambda v=view: len(v.text) > 0, timeout=300)
            # the input stays live while tokens stream in
            await pilot.press("x")
            assert app.prompt.text == "x"
            app.prompt.clear()
            await wait_idle(app, pilot, timeout=300)
            assert expected in view.text
            s = app.panel.stats
            assert s.kv_bytes_actual == s.kv_bytes_predicted > 0, (policy, s)
            assert s.policy == app.engine.policy.describe()
        assert app.panel.stats.kv_tokens > 0
        # the window turn evicted tokens; the plot has a point per token
        assert len(app.panel.series.points) > 5
        assert [m.role for m in app.query(MessageView)] == ["user", "assistant"] * 3
        # all MLX work (load, 3 turns, 2 policy changes) ran on the one worker thread
        assert app.engine.owner == app.worker.ident


LONG = "Summarize this text. " + "The river runs past the old mill and the town. " * 50


@sync
async def test_prefill_is_plotted_and_stops_within_one_step(default_model_path, preloaded):
    settings = GenerationSettings(max_tokens=2, prefill_step=PREFILL_STEP)
    engine = ChatEngine(real_opener(), settings, given=GREEDY)
    app = ChatApp(engine, model=str(default_model_path))
    log: list = []  # everything the worker hands the UI, and when the stop came
    put = app.pipe.put
    app.pipe.put = lambda item: (log.append(item), put(item))
    cancel = engine.cancel
    engine.cancel = lambda: (log.append("cancel"), cancel())
    async with app.run_test(size=(130, 40)) as pilot:
        await wait_idle(app, pilot, timeout=300)
        # 1. a whole prefill: the cache grows chunk by chunk and the panel follows it
        await send(app, pilot, LONG, timeout=600)
        progress = [e for e in log if isinstance(e, PrefillProgress)]
        total = progress[-1].total
        assert total > 8 * PREFILL_STEP and len(progress) >= total // PREFILL_STEP
        sizes = [e.stats.kv_bytes_actual for e in progress]
        assert sizes == sorted(sizes) and sizes[0] > 0
        for e in progress:  # what the caches hold (nbytes) vs the memory model, per step
            assert e.stats.kv_bytes_actual == e.stats.kv_bytes_predicted, e
        assert [e.stats.kv_tokens_seen for e in progress[:3]] == [64, 128, 192]
        during = [p for p in app.panel.series.points if 0 < p[0] < total]
        assert len(during) >= 3 and during[-1][1] > during[0][1] > 0
        # 2. Esc during a long prefill stops it at the end of the step that was running
        await pilot.press("ctrl+l")
        await wait_idle(app, pilot)
        log.clear()
        await send(app, pilot, LONG, wait=False, timeout=120)
        await wait_for(pilot, lambda: any(isinstance(e, PrefillProgress) for e in log), 300)
        await pilot.press("escape")
        await wait_idle(app, pilot, timeout=300)
        at = log.index("cancel")
        before = [e.done for e in log[:at] if isinstance(e, PrefillProgress)]
        after = [e.done for e in log[at:] if isinstance(e, PrefillProgress)]
        finished = next(e for e in log if isinstance(e, Finished))
        assert finished.finish_reason == "cancelled"
        read = finished.stats.kv_tokens_seen  # what the cache holds: the tokens read
        assert len(after) <= 1 and read - before[-1] <= PREFILL_STEP
        assert read < total  # it did not read the whole prompt
        view = app.chat.last_message("assistant")
        assert str(view.query_one(".meta").render()).startswith("stopped")


@sync
async def test_window_dims_what_left_and_resume_keeps_policy_and_history(
    default_model_path, tmp_path, monkeypatch, preloaded
):
    monkeypatch.setattr("tui.conversations.chats_dir", lambda: tmp_path)
    first = [str(default_model_path), "--kv-window", "32", "--kv-sinks", "4", "--temp", "0"]
    args = build_parser().parse_args(["chat", *first, "--max-tokens", "12"])
    app = build_app(args)
    async with app.run_test(size=(130, 40)) as pilot:
        await wait_idle(app, pilot, timeout=300)
        assert app.engine.settings.temperature == 0.0  # --temp 0 stays greedy
        await send(app, pilot, "What is the capital of France?", timeout=300)
        await send(app, pilot, "Name three rivers of Europe and a city on each.", timeout=300)
        s = app.panel.stats
        assert s.kv_evicted > 0 and s.kv_tokens == 36  # read from the caches
        views = app.chat.messages()
        spans = app.engine.message_spans()
        gone = 4 + s.kv_evicted  # the sinks stay, then the oldest tokens go first
        for view, (start, end) in zip(views, spans, strict=True):
            assert view.has_class("evicted") == (end <= gone), (view.role, start, end, gone)
        assert views[0].has_class("evicted") and not views[-1].has_class("evicted"), (spans, s)
        messages = app.engine.messages
    (kept,) = tmp_path.glob("chat-*.json")
    args = build_parser().parse_args(["chat", "--resume", "--max-tokens", "12"])
    app = build_app(args)
    async with app.run_test(size=(130, 40)) as pilot:
        await wait_idle(app, pilot, timeout=300)
        assert app.engine.messages == messages
        assert [(m.role, m.text) for m in app.chat.messages()] == [
            (m["role"], m["content"]) for m in messages
        ]
        assert app.engine.policy == KVPolicy(window=32, sinks=4)
        await send(app, pilot, "Thanks!", timeout=300)
    assert len(json.loads(kept.read_text())["messages"]) == len(messages) + 2
