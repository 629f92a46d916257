"""What one all-reduce costs between ranks: the floor under tensor-parallel decoding.

    mlx.launch -n 3 -- python benchmarks/allreduce_latency.py [--size 576] [--repeats 100]

A tensor-parallel decode step of a llama-family model runs two all-reduces per layer
(attention output and MLP output), each the size of one hidden state (576 floats for
SmolLM2-135M): 60 of them per token over its 30 layers. Rank 0 prints the mean time of one
all-reduce, evaluated one at a time as decoding does.
"""

from __future__ import annotations

import argparse
import json
import time

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX


def main(argv=None) -> int:
    import mlx.core as mx

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=576, help="floats per all-reduce")
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args(argv)
    group = mx.distributed.init()
    x = mx.ones((1, 1, args.size))
    mx.eval(mx.distributed.all_sum(x, group=group))  # connect
    tic = time.perf_counter()
    for _ in range(args.repeats):
        mx.eval(mx.distributed.all_sum(x, group=group))
    seconds = (time.perf_counter() - tic) / args.repeats
    if group.rank() == 0:
        result = {"ranks": group.size(), "floats": args.size, "all_sum_ms": round(seconds * 1e3, 3)}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
