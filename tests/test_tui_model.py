"""The chat app over the real engine and the offline default model (SmolLM2-135M)."""

from __future__ import annotations

import pytest

from mlxkv.engine.session import GenerationSettings
from tests.tui_pilot import send, sync, wait_for, wait_idle
from tui.app import ChatApp
from tui.chat_view import MessageView, Note
from tui.engine import ChatEngine, real_opener

pytestmark = pytest.mark.model
GREEDY = {"temperature", "top_p", "repetition_penalty"}  # as if given on the command line


@sync
async def test_real_model_streams_and_panel_matches_under_three_policies(default_model_path):
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
        assert app.engine.threads == {app.worker.ident}
