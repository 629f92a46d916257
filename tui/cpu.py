"""CPU time per thread group, to measure what the UI costs the decoder.

Wall-clock tok/s on a shared machine is noisy; CPU seconds are not. The UI's share is the
CPU of the Python threads other than the MLX worker (Textual's event loop, its input and
writer threads); the engine's is the worker plus the threads Python does not know
(MLX/OpenBLAS compute threads). Linux only (/proc); elsewhere returns None.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu() -> dict[int, float] | None:
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    out = {}
    for task in tasks.iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    return out


def split_cpu(worker_native_id: int | None) -> tuple[float, float] | None:
    """(ui_seconds, engine_seconds) of CPU used so far by this process."""
    per_thread = _thread_cpu()
    if per_thread is None:
        return None
    python_ui = {t.native_id for t in threading.enumerate()} - {worker_native_id}
    ui = sum(v for tid, v in per_thread.items() if tid in python_ui)
    return ui, sum(per_thread.values()) - ui
