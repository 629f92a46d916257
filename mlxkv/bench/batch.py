"""Batch throughput: ``mlxkv batch`` (the real command) vs the prompts one
by one through the engine vs mlx-lm ``batch_generate``, interleaved per round.

The measuring functions are ``benchmarks/batch_bench.py``'s (same
prompts, same counting); it lives in the source tree, not the installed package, so the
section is skipped with a message when it is not there.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from mlxkv.bench.sources import script


def measure(loaded, n_prompts: int, max_tokens: int, rounds: int, log) -> dict | None:
    bb = script("batch_bench")
    if bb is None:
        log("batch: benchmarks/batch_bench.py not found (source checkout only); skipped")
        return None
    qs = bb.prompts(n_prompts)
    runs = {"mlxkv_batch": [], "one_by_one": [], "mlx_lm_batch_generate": []}
    with tempfile.TemporaryDirectory() as tmp:
        bb.run_mlx_lm(loaded, qs[:2], 2)  # warm-up
        for r in range(rounds):
            runs["mlxkv_batch"].append(_mlxkv_batch(bb, loaded, qs, max_tokens, Path(tmp)))
            runs["mlx_lm_batch_generate"].append(bb.run_mlx_lm(loaded, qs, max_tokens))
            runs["one_by_one"].append(bb.run_one_by_one(loaded, qs, max_tokens))
            tps = {k: round(v[-1]["tokens"] / v[-1]["seconds"], 1) for k, v in runs.items()}
            log(f"batch round {r + 1}/{rounds}: tok/s {tps}")

    def tps(x):
        return x["tokens"] / x["seconds"]

    def paired(a, b):
        return statistics.median(tps(x) / tps(y) for x, y in zip(runs[a], runs[b], strict=True))

    return {
        "mode": "in process",
        "prompts": n_prompts,
        "max_tokens": max_tokens,
        "batch_size": n_prompts,
        "rounds": rounds,
        "median_tps": {k: statistics.median(map(tps, v)) for k, v in runs.items()},
        "tokens": {k: [x["tokens"] for x in v] for k, v in runs.items()},
        "ratio_vs_one_by_one": paired("mlxkv_batch", "one_by_one"),
        "ratio_vs_mlx_lm": paired("mlxkv_batch", "mlx_lm_batch_generate"),
    }


def _mlxkv_batch(bb, loaded, qs, max_tokens, workdir: Path) -> dict:
    """``mlxkv batch``'s engine in process (warm: the loaded model is handed over)."""
    return bb.run_mlxkv_batch(loaded, qs, max_tokens, len(qs), workdir, False)
