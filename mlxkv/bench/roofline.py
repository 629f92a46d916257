"""Roofline for decoding: one decoded token reads every weight once plus the KV cache it
attends to, so memory bandwidth / bytes per token is an upper bound on decode tok/s.

Bandwidth is measured two ways: a numpy sum over a large float32 array (one core, the
plain streaming-read number) and an MLX sum (what MLX's own kernels reach).
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def numpy_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    a = np.ones(nbytes // 4, dtype=np.float32)
    a.sum()  # touch the pages first
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - tic)
    return a.nbytes / min(times)


def mlx_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    import mlx.core as mx

    a = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(a)
    mx.eval(a.sum())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(a.sum())
        times.append(time.perf_counter() - tic)
    return a.nbytes / min(times)


def measure_bandwidth(nbytes: int) -> dict:
    # Interleave the two probes and keep each one's best: a busy neighbour only slows us.
    np_bw, mx_bw = [], []
    for _ in range(2):
        np_bw.append(numpy_read_bandwidth(nbytes))
        mx_bw.append(mlx_read_bandwidth(nbytes))
    return {"bytes": nbytes, "numpy_sum": max(np_bw), "mlx_sum": max(mx_bw)}


def bound(bandwidth: float, weight_bytes: int, kv_bytes: int) -> float:
    """Decode tok/s if every token only had to read weights + KV once at ``bandwidth``."""
    return bandwidth / (weight_bytes + kv_bytes)


def rows(bw: dict, weight_bytes: int, points: list[tuple[str, float, int]]) -> list[dict]:
    """``points``: (what, measured decode tok/s, KV bytes read per token)."""
    best = max(bw["numpy_sum"], bw["mlx_sum"])
    out = []
    for what, tps, kv in points:
        b = bound(best, weight_bytes, kv)
        out.append(
            {
                "what": what,
                "decode_tps": tps,
                "bytes_per_token": weight_bytes + kv,
                "bound_tps": b,
                "fraction": tps / b,
                "achieved_gbs": tps * (weight_bytes + kv) / 1e9,
            }
        )
    return out


def median(xs):
    return statistics.median(xs) if xs else float("nan")
