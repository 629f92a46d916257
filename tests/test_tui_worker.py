"""The chat's MLX worker thread: every job runs on it, and a process whose MLX work ran
there exits cleanly (no SIGABRT from MLX's per-thread state at exit)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from tui.worker import MLXWorker

# A tiny random llama decodes a few tokens with mlx-lm's generate_step on the worker, as a
# chat turn does, then the process exits. With the thread joined before exit, 9 runs of 10
# aborted ("terminate called without an active exception", exit 134).
SCRIPT = """
import mlx.core as mx
from mlx_lm.generate import generate_step
from tests.tiny_models import tiny_llama
from tui.worker import MLXWorker

def job():
    model = tiny_llama(layers=2, hidden=64, heads=2, kv_heads=1, vocab=256)
    for i, _ in enumerate(generate_step(mx.array([1, 2, 3]), model, max_tokens=20)):
        if i == 5:
            break
    print("decoded", flush=True)

worker = MLXWorker()
worker.submit(job)
assert worker.finish(60)
"""


def test_a_process_whose_mlx_work_ran_on_the_worker_exits_cleanly():
    root = str(Path(__file__).parent.parent)
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=root,
        )
        assert (run.returncode, run.stdout, run.stderr) == (0, "decoded\n", "")


def test_jobs_run_in_order_on_one_thread_and_finish_waits_for_them():
    worker = MLXWorker()
    ran: list[tuple[int, int]] = []
    gate = threading.Event()
    worker.submit(lambda: gate.wait(10))
    for i in range(3):
        worker.submit(lambda i=i: ran.append((i, threading.get_ident())))
    assert not worker.finish(0.05)  # the first job still waits
    gate.set()
    assert worker.finish(10)
    assert [i for i, _ in ran] == [0, 1, 2]
    assert {t for _, t in ran} == {worker.ident} != {threading.get_ident()}
    worker.submit(lambda: ran.append((9, 0)))  # after finish: dropped
    assert worker.finish(10) and len(ran) == 3
    assert worker._thread.is_alive()  # parked, never ended before the process
