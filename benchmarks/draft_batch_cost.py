"""What a model call costs for B rows of T tokens each, on the default model: the price of
checking drafts in a batch (each row feeds its token and T - 1 drafts).

    python benchmarks/draft_batch_cost.py [--context 300] [--calls 8]

Each row's cache holds --context tokens first; every call is trimmed back, so all calls
run at that context. Prints the median milliseconds of --calls calls per (B, T), and the
tokens a row must keep per step for a step of T to beat T steps of one token
(``T=1 cost / row``, what drafts must average to pay).
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlxkv.models.loader import load  # noqa: E402
from mlxkv.models.resolve import resolve  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="model call cost for B rows of T tokens")
    parser.add_argument("--context", type=int, default=300, help="tokens in each row's cache")
    parser.add_argument("--calls", type=int, default=8, help="timed calls per (B, T)")
    args = parser.parse_args()
    model = load(resolve(None).path).model
    print(f"context {args.context}, median of {args.calls} calls")
    print("| rows B | T=1 | T=3 | T=5 | T=9 | tokens a row must keep per step to pay at T=9 |")
    print("|---|---|---|---|---|---|")
    for rows in (1, 2, 4):
        cost = {}
        for t in (1, 3, 5, 9):
            caches = make_prompt_cache(model)
            mx.eval(model(mx.ones((rows, args.context), dtype=mx.int32), cache=caches))
            x = mx.ones((rows, t), dtype=mx.int32)
            times = []
            for i in range(args.calls + 2):  # two warm-up calls
                start = time.perf_counter()
                mx.eval(model(x, cache=caches))
                if i >= 2:
                    times.append(time.perf_counter() - start)
                for c in caches:
                    c.trim(t)
            cost[t] = statistics.median(times) * 1000
        row = " | ".join(f"{cost[t]:.0f} ms" for t in (1, 3, 5, 9))
        print(f"| {rows} | {row} | {cost[9] / cost[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
