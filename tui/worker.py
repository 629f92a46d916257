"""The one thread that does all MLX work.

MLX streams are per thread (mlx >= 0.31): arrays made on one thread and evaluated on
another fail or sync badly. Loading, every generation and every cache reset therefore
run here, in submission order; the UI thread only posts jobs and reads events.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class MLXWorker:
    def __init__(self, name: str = "mlxkv-mlx"):
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
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
        errors (an escaping exception is swallowed so the worker survives)."""
        self._jobs.put(job)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # noqa: BLE001 - jobs report their own errors; keep serving
                pass

    def stop(self, timeout: float = 2.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)
