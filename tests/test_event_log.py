"""The kept events of streamed background responses: readers from any point, waiting for
more while the answer runs, and the bound on the bytes kept."""

from __future__ import annotations

import asyncio

from mlxkv.server.event_log import EventLog, EventLogs


async def _read(log: EventLog, after: int) -> list[str]:
    return [e async for e in log.read(after)]


def test_readers_get_the_events_after_their_point_and_wait_for_the_rest():
    async def run():
        log = EventLog()
        log.add(["a", "b"])
        early = asyncio.ensure_future(_read(log, -1))
        late = asyncio.ensure_future(_read(log, 1))
        await asyncio.sleep(0)
        assert not early.done()  # the answer runs on: the readers wait
        log.add(["c"])
        await asyncio.sleep(0)
        log.add(["d"])
        log.end()
        return await early, await late, await _read(log, 2), await _read(log, 9)

    assert asyncio.run(run()) == (["a", "b", "c", "d"], ["c", "d"], ["d"], [])


def test_the_logs_of_ended_answers_go_oldest_first_past_the_bound():
    async def run():
        logs = EventLogs(limit=10)
        old, running, new = logs.open("old"), logs.open("running"), logs.open("new")
        old.add(["x" * 6])
        running.add(["é" * 4])  # 8 bytes as UTF-8
        new.add(["y" * 2])
        old.end()
        new.end()
        logs.trim()
        first = sorted(logs.logs)
        running.add(["z"])
        running.end()
        logs.trim()
        return first, sorted(logs.logs)

    # 16 bytes: the old ended log goes (10 left), not the running one; past the bound again
    # once that one has ended, it goes before the newer one
    assert asyncio.run(run()) == (["new", "running"], ["new"])
