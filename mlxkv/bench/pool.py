"""Run stream jobs side by side on a CPU: one worker process per core, pinned, one BLAS thread.

MLX's CPU backend runs element-wise ops (the softmax's exp, SiLU; most of a prefill on the
default model) on a single thread, so one stream leaves the second core mostly idle. Two
pinned workers finish two streams in about the time of one, and each job still has a core
to itself, so timings within a job (start vs end of a stream) and across jobs compare.
Measured on the 2-core box: one pinned worker alone 57.3 tok/s (RotatingKVCache prefill,
2048 tokens), two at once 65.1 and 61.9 tok/s. Decode timings are memory-bound, so they
take the machine to themselves (:class:`Gate`).

On a GPU (macOS) or with ``workers=1`` the jobs run in this process, one after another.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass


class Gate:
    """Prefill chunks run side by side (``shared``); a decode timing runs ``exclusive``:
    it waits for the other workers to finish their current chunk, and they wait for it.
    Decode is memory-bound, so a neighbour's prefill would slow it (seen: a sink+window
    decode timed 0.63x at the end of a stream vs its start, 1.02x in a run where it did not
    overlap)."""

    def __init__(self, ctx):
        self._cond = ctx.Condition()
        self._active = ctx.Value("i", 0, lock=False)  # workers inside a shared section
        self._excl = ctx.Value("i", 0, lock=False)  # 1 while a decode wants or has the machine

    @contextmanager
    def shared(self):
        with self._cond:
            while self._excl.value:
                self._cond.wait()
            self._active.value += 1
        try:
            yield
        finally:
            with self._cond:
                self._active.value -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            while self._excl.value:
                self._cond.wait()
            self._excl.value = 1
            while self._active.value:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._excl.value = 0
                self._cond.notify_all()


@dataclass(frozen=True)
class Job:
    name: str  # key of the result
    config: str  # CacheConfig key
    tokens: int  # the stream is ids[: tokens + 1]
    checkpoints: tuple[int, ...]
    decode: int
    decode_start: bool
    cost: float = 0.0  # rough run time, to start the longest jobs first


def default_workers() -> int:
    """One per core on a Linux CPU device (where pinning works), else 1."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu or not hasattr(os, "sched_setaffinity"):
        return 1
    return max(1, len(os.sched_getaffinity(0)))


def _run_job(model, cfgs, ids, chunk, job: Job, log, gate=None):
    from mlxkv.bench.stream import run_stream

    marks = [job.tokens * q // 4 for q in (1, 2, 3, 4)]

    def progress(done, total):
        if marks and done >= marks[0]:
            while marks and done >= marks[0]:
                marks.pop(0)
            log(f"{job.name}: {done}/{total} tokens")

    cfg = cfgs[job.config]
    return run_stream(
        job.config, model, cfg.factory(model), ids[: job.tokens + 1], chunk, job.checkpoints,
        job.decode, decode_start=job.decode_start, on_chunk=progress, gate=gate,
    )  # fmt: skip


def _worker(core, model_path, kept, sinks, ids, chunk, jobs_q, results_q, gate):
    os.sched_setaffinity(0, {core})
    from mlxkv.backend import setup_blas

    setup_blas()  # a spawned process: its own BLAS set-up, before MLX loads
    from pathlib import Path

    from mlxkv.bench.configs import all_configs
    from mlxkv.models.loader import load

    def log(msg):
        print(f"mlxkv bench [core {core}]: {msg}", file=sys.stderr, flush=True)

    try:
        model = load(Path(model_path)).model
        cfgs = all_configs(kept, sinks)
        while (job := jobs_q.get()) is not None:
            result = _run_job(model, cfgs, ids, chunk, job, log, gate)
            results_q.put((job.name, result, None))
    except BaseException as e:  # report, so the parent does not wait forever
        results_q.put((None, None, f"{type(e).__name__}: {e}"))


def run_jobs(
    jobs: list[Job],
    *,
    loaded,
    cfgs,
    ids: list[int],
    chunk: int,
    kept: int,
    sinks: int,
    workers: int,
    log: Callable[[str], None],
    on_result: Callable[[str], None] | None = None,
) -> dict:
    """Results of ``jobs`` by name (a ``StreamResult`` each)."""
    jobs = sorted(jobs, key=lambda j: -j.cost)
    out = {}
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            out[job.name] = _run_job(loaded.model, cfgs, ids, chunk, job, log)
            if on_result:
                on_result(job.name)
        return out

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    jobs_q, results_q, gate = ctx.Queue(), ctx.Queue(), Gate(ctx)
    for job in jobs:
        jobs_q.put(job)
    cores = sorted(os.sched_getaffinity(0))[:workers]
    for _ in cores:
        jobs_q.put(None)
    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read once, when the worker loads OpenBLAS
    try:
        procs = [
            ctx.Process(
                target=_worker,
                args=(c, str(loaded.path), kept, sinks, ids, chunk, jobs_q, results_q, gate),
                daemon=True,
            )
            for c in cores
        ]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("OPENBLAS_NUM_THREADS", None)
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = saved
    log(f"{len(jobs)} stream jobs on {len(procs)} pinned workers (cores {cores})")
    try:
        while len(out) < len(jobs):
            name, result, error = results_q.get()
            if error:
                raise RuntimeError(f"a benchmark worker failed: {error}")
            out[name] = result
            if on_result:
                on_result(name)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return out
