"""Single-sequence cache policies against the nearest mlx-lm cache: prefill and decode tok/s.

    python benchmarks/policy_speed.py TEXT_FILE [--pairs sink-window,window,...]
        [--prompt 1536] [--decode 32] [--rounds 5] [--kept 1024] [--sinks 4]

The pairs of ``mlxkv bench``'s speed section (``mlxkv.bench.configs``), but all in one
process and interleaved: every round runs each pair's two sides back to back (order
alternating between rounds), so a busy minute on a shared machine hits both sides alike.
A run: a fresh cache, the first ``--prompt`` tokens of the text prefilled as the engine
feeds them (chunks of 512, sink caches 64 once evicting; the caches evaluated after each
chunk, the logits not: that is how mlx-lm's ``generate_step`` prefills), then ``--decode``
greedy tokens with mlx-lm's ``generate_step``. Printed: the median over rounds of each
side's tok/s and the median of the per-round ratios mlxkv / mlx-lm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX


def prefill_tps(model, caches, ids: list[int], chunk: int) -> float:
    from mlxkv.engine.scheduler import prefill

    tic = time.perf_counter()
    prefill(model, caches, ids, 0, len(ids), chunk)
    return len(ids) / (time.perf_counter() - tic)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("text", type=Path)
    ap.add_argument("--pairs", default="sink-window,window,sink-4bit,4bit,8bit")
    ap.add_argument("--prompt", type=int, default=1536)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kept", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args(argv)

    import mlx.core as mx

    from mlxkv.bench.configs import all_configs
    from mlxkv.bench.corpus import token_stream
    from mlxkv.bench.stream import decode_tps
    from mlxkv.models.loader import load
    from mlxkv.models.resolve import resolve

    loaded = load(resolve(None).path)
    model = loaded.model
    ids, _ = token_stream(loaded.tokenizer, args.text.read_text(), args.prompt)
    configs = all_configs(args.kept, args.sinks)
    keys = args.pairs.split(",")
    sides = {k: (configs[k], configs[configs[k].peer]) for k in keys}
    results = {k: {"prefill": [], "decode": []} for k in keys}
    loads = []
    for c in {c.key: c for pair in sides.values() for c in pair}.values():
        c.factory(model)()  # mlxkv's caches route the model's attention once, up front
    for r in range(args.rounds):
        for k, (a, b) in sides.items():
            runs = {}
            for c in (a, b) if r % 2 == 0 else (b, a):
                caches = c.factory(model)()
                p = prefill_tps(model, caches, ids[:-1], args.chunk)
                d = decode_tps(model, caches, ids[-1], args.decode)
                runs[c.key] = (p, d)
                del caches
                mx.clear_cache()
            (pa, da), (pb, db) = runs[a.key], runs[b.key]
            results[k]["prefill"].append((pa, pb))
            results[k]["decode"].append((da, db))
            loads.append(os.getloadavg()[0])
            print(
                f"round {r + 1} {a.label} / {b.label}: prefill {pa:.1f}/{pb:.1f}, "
                f"decode {da:.2f}/{db:.2f}",
                flush=True,
            )
    print(
        f"\n# {loaded.name} ({loaded.dtype}), prompt {args.prompt}, decode {args.decode}, "
        f"{args.rounds} rounds interleaved; load average (1 min) median "
        f"{statistics.median(loads):.2f}, min {min(loads):.2f}, max {max(loads):.2f}"
    )
    print("| mlxkv | mlx-lm | prefill tok/s | ratio | decode tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for k, (a, b) in sides.items():
        cells = []
        for what in ("prefill", "decode"):
            v = results[k][what]
            ma, mb = statistics.median(x for x, _ in v), statistics.median(y for _, y in v)
            ratio = statistics.median(x / y for x, y in v)
            cells.append(f"{ma:.2f} / {mb:.2f} | {ratio:.3f}")
        print(f"| {a.label} | {b.label} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
