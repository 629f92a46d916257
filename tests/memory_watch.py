"""What MLX holds beyond what the scheduler counts, step by step, for the tests that check
a request stays within its reservation."""

from __future__ import annotations

import gc
from collections.abc import Callable


def worst_beyond_counted(scheduler, handle, before: int, counted: Callable[[dict], int]) -> int:
    """Step ``scheduler`` until ``handle`` is done; the most MLX held beyond ``before`` and
    ``counted(status["memory"])`` after any step (garbage collected first)."""
    import mlx.core as mx

    worst = -(1 << 30)
    gc.collect()
    gc.freeze()  # each step's collection then walks the step's new objects only
    try:
        while not handle.done:
            scheduler.step()
            memory = scheduler.status()["memory"]
            gc.collect()
            worst = max(worst, mx.get_active_memory() - before - counted(memory))
    finally:
        gc.unfreeze()
    return worst
