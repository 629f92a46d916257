"""The one thread that does all MLX work.

MLX streams are per thread (mlx >= 0.31): arrays made on one thread and evaluated on
another fail or sync badly. Loading, every generation and every cache reset therefore
run here, in submission order; the UI thread only posts jobs and reads events.

The thread never ends before the process does. When a thread that ran MLX work exits,
MLX's per-thread state goes with it, and the process then often aborts as it exits
("terminate called without an active exception", SIGABRT): 5 of 12 runs of a generation
on a thread that was joined, 0 of 12 with the thread left waiting for its next job.
``finish`` therefore waits for the running job and leaves the thread parked.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class MLXWorker:
    def __init__(self, name: str = "mlxkv-mlx"):
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopped = False
        # Daemon: a model load cannot be interrupted, and quitting must not wait for it.
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker after the jobs already queued; it must catch its own
        errors (an escaping exception is swallowed so the worker survives). Jobs submitted
        after ``finish`` are dropped."""
        if not self._stopped:
            self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - jobs report their own errors; keep serving
                pass

    def finish(self, timeout: float) -> bool:
        """Take no more jobs and wait up to ``timeout`` seconds for the queued ones to end;
        True when they did. The thread stays (parked) until the process exits."""
        self._stopped = True
        idle = threading.Event()
        self._jobs.put(idle.set)
        return idle.wait(timeout)
