"""The server's bridge to the scheduler, in one process: a shutdown cut that the engine
never answers still ends every row, with the shutting_down error."""

from __future__ import annotations

import asyncio
import threading

import pytest

import mlxkv.server.bridge as bridge_module
from mlxkv.engine.events import Failed, TokenDelta
from mlxkv.engine.request import GenerationSettings
from mlxkv.engine.scheduler import Scheduler
from mlxkv.server.bridge import Bridge


@pytest.mark.model
def test_rows_the_engine_never_ends_after_a_cut_end_with_shutting_down(default_model, monkeypatch):
    """The engine stuck inside a step (across ranks: a collective that waits on a rank that
    died) never answers the cancels of the shutdown's cut: ENGINE_SILENCE later the bridge
    ends each row itself, so a client's stream gets an error, not silence. The same through
    a real server whose rank stops: tests/test_serve_distributed.py (slow)."""
    monkeypatch.setattr(bridge_module, "ENGINE_SILENCE", 0.2)
    model_class = type(default_model.model)
    real_call = model_class.__call__
    stick, stuck, release = threading.Event(), threading.Event(), threading.Event()

    def call(self, *args, **kwargs):
        if stick.is_set():
            stuck.set()
            release.wait(120)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(model_class, "__call__", call)
    scheduler = Scheduler(default_model)
    scheduler.start()
    bridge = Bridge(scheduler, max_batch=4, max_queue=4)
    ids = scheduler.encode("Count from one to one hundred.")

    async def shut_down_while_stuck():
        run = bridge.start([ids], 2, GenerationSettings(max_tokens=200), None, None)
        events = [await run.next()]
        while not isinstance(events[-1][1], TokenDelta):
            events.append(await run.next())
        stick.set()
        assert await asyncio.to_thread(stuck.wait, 120)
        bridge.drain(0.0)
        while run.open:  # bounded: a bridge that waited on the engine would wait for good
            events.append(await asyncio.wait_for(run.next(), 60))
        return run, events

    try:
        run, events = asyncio.run(shut_down_while_stuck())
        assert run.shutdown and bridge.draining
        assert not any(h.done for h in run.handles)  # the engine answered nothing
        ended = [(row, e) for row, e in events if isinstance(e, Failed)]
        message = "the server stopped before this answer ended (its engine did not answer the cut)"
        assert ended == [
            (0, Failed(message, "shutting_down")),
            (1, Failed(message, "shutting_down")),
        ]
    finally:
        release.set()
        scheduler.close(timeout=60)
