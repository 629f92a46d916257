"""Between the event loop and the scheduler's thread: submit rows, get their events back.

The scheduler calls each request's sink on its own (MLX) thread; the sink only hands the
event to the event loop (``call_soon_threadsafe``), so neither side ever waits on the other.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Protocol

from mlxkv.engine.events import Failed, Finished
from mlxkv.engine.request import GenerationSettings
from mlxkv.engine.scheduler import Request, RequestHandle
from mlxkv.errors import UserError
from mlxkv.policy import KVPolicy
from mlxkv.server.errors import APIError

# Seconds the runs cut at shutdown wait for the engine's answer before the server ends them.
ENGINE_SILENCE = 3.0


class SchedulerAPI(Protocol):
    """What the server uses of ``mlxkv.engine.scheduler.Scheduler``."""

    def encode(self, text: str) -> list[int]: ...

    def submit(self, request: Request) -> RequestHandle: ...

    def status(self) -> dict: ...

    def close(self, timeout: float = 10.0) -> None: ...


class Run:
    """The rows of one HTTP request (n answers, or several prompts) and their events, in
    arrival order, as ``(row, event)`` pairs."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rows: int):
        self.loop = loop
        self.rows = rows
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles: list[RequestHandle] = []
        self.open = rows  # rows without their Finished or Failed yet
        self.ended: set[int] = set()  # rows whose Finished or Failed was read
        self.shutdown = False  # cut by the server's shutdown, not by the client

    def sink(self, row: int):
        def put(event) -> None:  # on the scheduler's thread: never block, never raise
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (row, event))
            except RuntimeError:  # the event loop is gone (the process is stopping)
                pass

        return put

    async def next(self):
        while True:
            row, event = await self.queue.get()
            if row not in self.ended:  # a row the server ended itself may still hear more
                break
        if isinstance(event, Finished | Failed):
            self.open -= 1
            self.ended.add(row)
        return row, event

    def cancel(self) -> None:
        for h in self.handles:
            if not h.done:
                h.cancel()


class Bridge:
    """Submits requests to the scheduler and keeps the runs in flight."""

    def __init__(self, scheduler: SchedulerAPI, max_batch: int, max_queue: int):
        self.scheduler = scheduler
        self.capacity = max_batch + max_queue  # rows running or waiting, at most
        self.live: set[Run] = set()
        self.draining = False
        self.refused_busy = 0  # requests answered 429

    @property
    def rows_in_flight(self) -> int:
        """Rows submitted and not finished, whether or not their client still reads."""
        for run in [r for r in self.live if all(h.done for h in r.handles)]:
            self.live.discard(run)
        return sum(not h.done for r in self.live for h in r.handles)

    def start(
        self,
        prompts: list[list[int]],
        n: int,
        settings: GenerationSettings,
        policy: KVPolicy | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        embed: str | None = None,
        prediction: list[int] | None = None,
    ) -> Run:
        """Submit ``n`` rows per prompt together (row ``p * n + j``: prompt p, answer j; a
        seed s gives answer j the seed s + j, so the answers differ and repeat); ``embed``:
        each row's answer is its prompt pooled (``Request.embed``)."""
        if self.draining:
            raise APIError(
                503, "the server is shutting down; no new requests are taken", code="shutting_down"
            )
        rows = len(prompts) * n
        busy = self.rows_in_flight
        if busy + rows > self.capacity:
            self.refused_busy += 1
            raise APIError(
                429,
                f"the server is busy: {busy} answers are running or queued and it holds "
                f"{self.capacity} (--max-batch + --max-queue); retry shortly",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
        run = Run(asyncio.get_running_loop(), rows)
        try:
            for p, ids in enumerate(prompts):
                for j in range(n):
                    s = settings
                    if j and s.seed is not None:
                        s = replace(s, seed=(s.seed + j) % 2**64)
                    req = Request(
                        ids=ids,
                        settings=s,
                        policy=policy,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                        sink=run.sink(p * n + j),
                        embed=embed,
                        prediction=prediction,
                    )
                    run.handles.append(self.scheduler.submit(req))
        except UserError as e:  # the scheduler is closing
            run.cancel()
            raise APIError(503, str(e), code="shutting_down") from None
        self.live.add(run)
        return run

    def finish(self, run: Run) -> None:
        """The HTTP side is done with ``run``: rows still going are cancelled."""
        run.cancel()
        self.live.discard(run)

    def drain(self, grace: float) -> None:
        """Shutdown: take no new requests; after ``grace`` seconds cut the runs left."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(grace, self.cut)

    def cut(self) -> None:
        """Cut every run left with the shutting_down error (at the end of the grace, or at
        once on a second Ctrl+C)."""
        for run in list(self.live):
            run.shutdown = True
            run.cancel()
        asyncio.get_running_loop().call_later(ENGINE_SILENCE, self._end_unanswered)

    def _end_unanswered(self) -> None:
        """Rows the engine has not ended since the cut end here, each with the shutting_down
        error: an engine that waits on a rank that died never answers a cancel, and its
        clients would otherwise see their streams stop without a word."""
        for run in list(self.live):
            for row, handle in enumerate(run.handles):
                if not handle.done and row not in run.ended:
                    stopped = Failed(
                        "the server stopped before this answer ended (its engine did not "
                        "answer the cut)",
                        "shutting_down",
                    )
                    run.queue.put_nowait((row, stopped))
