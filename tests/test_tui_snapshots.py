"""Snapshots of the main layout over the scripted engine (deterministic figures).

Regenerate after an intended change: pytest tests/test_tui_snapshots.py --snapshot-update
(Textual is pinned in pyproject.toml, so the SVGs only change when the UI does).
"""

from __future__ import annotations

from tests.tui_pilot import fake_app, send, settle, wait_idle

SIZE = (120, 36)


def test_layout_after_an_answer(snap_compare):
    async def run_before(pilot):
        await wait_idle(pilot.app, pilot)
        await send(pilot.app, pilot, "What is the capital of France?")
        await send(pilot.app, pilot, "Show me some code")
        await settle(pilot)

    assert snap_compare(fake_app(), terminal_size=SIZE, run_before=run_before)


def test_layout_window_policy_and_error(snap_compare):
    async def run_before(pilot):
        app = pilot.app
        await wait_idle(app, pilot)
        await send(app, pilot, "/policy window=32 sinks=4 bits=4")
        await send(app, pilot, "Show me some code " * 10)
        await send(app, pilot, "/policy window=8")  # first the cost of re-reading
        await send(app, pilot, "/policy window=8")  # then refused: an error note
        await settle(pilot)

    assert snap_compare(fake_app(), terminal_size=SIZE, run_before=run_before)


def test_loading_error_screen(snap_compare):
    async def run_before(pilot):
        await settle(pilot)

    assert snap_compare(fake_app(model="no-such-model"), terminal_size=SIZE, run_before=run_before)
