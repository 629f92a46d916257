"""MLX's peak memory for one cache on the Llama-3.1-8B-shaped model, against ``plan``.

    python benchmarks/gpu_peak.py [--quick] [--device gpu|cpu] [--context 32768]
        [--policy full] [--side mlxkv|mlx-lm] [--weights bf16|q4] [--presize] [--decode 32]

One run per process, so that MLX's settings read at start (MLX_MAX_OPS_PER_BUFFER,
MLX_MAX_MB_PER_BUFFER, MLX_USE_CUDA_GRAPHS, MLX_CUDA_USE_CUDNN_SDPA) can be compared: run
it once per setting. Prints one JSON line: the peak after the prefill and after decoding,
the plan's parts, and the excess over the plan as a multiple of the cache's bytes; and the
same in one line of words on stderr. What it measures: ``measure_peak`` in mlxkv/bench/gpu.py;
why: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys

from mlxkv.backend import free_streams, setup_blas

setup_blas()  # route MLX's CPU matmuls to OpenBLAS before anything imports MLX


def main(argv=None) -> int:
    from mlxkv.bench import gpu
    from mlxkv.errors import UserError

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (a CPU smoke run)")
    ap.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens (default 32768)")
    ap.add_argument("--policy", default="full", help=f"one of {','.join(gpu.POLICIES)}")
    ap.add_argument("--side", default="mlxkv", choices=gpu.SIDES, help="whose cache runs")
    ap.add_argument("--weights", default="bf16", help="bf16 or q4")
    ap.add_argument("--presize", action="store_true", help="full cache: size it before prefill")
    ap.add_argument("--decode", type=int, help="decode tokens after the prefill (default 32)")
    args = ap.parse_args(argv)
    try:
        s = gpu.settings(
            args.quick, [args.context], [args.policy], [args.weights], args.device, args.decode
        )
        result = gpu.measure_peak(
            s, args.weights, args.context, args.policy, args.side, args.presize
        )
    except UserError as e:
        print(f"gpu_peak: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    print(summary(result), file=sys.stderr)
    return 0


def summary(r: dict) -> str:
    """One line: the run, the settings it ran under, its peak against the plan."""
    from mlxkv.bench.gpu import size_text

    settings = " ".join(f"{k}={v}" for k, v in r["env"].items()) or "MLX's defaults"
    return (
        f"{r['cache']} ({r['side']}{', presized' if r['presize'] else ''}), "
        f"{r['context']:,} tokens, {settings}: peak {size_text(r['peak_bytes'])} "
        f"({size_text(r['peak_after_prefill'])} after the prefill), plan "
        f"{size_text(r['plan']['mlx'])} ({r['peak_over_plan']:.3f}); excess "
        f"{r['excess_over_kv']:.2f}x the cache's {size_text(r['kv_bytes'])}"
    )


if __name__ == "__main__":
    atexit.register(free_streams)
    sys.exit(main())
