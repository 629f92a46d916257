"""mlxkv's caches against mlx-lm's on a Llama-3.1-8B-shaped model (random weights), on the GPU.

    python benchmarks/gpu_bench.py [--quick] [--device gpu|cpu] [--contexts 4096,32768,131072]
        [--policies full,sink-window,4bit,8bit,sink-4bit,4bit-plain] [--weights bf16,q4]
        [--decode 32] [--rounds 2] [--budget SECONDS] [--sink-chunk 64,256,512]
        [--out results/gpu]

bfloat16 and MLX 4-bit (group 64) weights; per context and policy, prefill and decode tok/s
of mlxkv and of its mlx-lm counterpart, interleaved; decode against the bandwidth bound;
16 rows batched against one; MLX's peak against ``plan``. Writes OUT.md (a markdown table)
and OUT.json. ``--quick``: a 2-layer, hidden-128 model at contexts 256 and 1,024 (a CPU
smoke run). What each number means: mlxkv/bench/gpu.py; how to run it on the lent GPU
machine: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
from pathlib import Path

from mlxkv.backend import free_streams, setup_blas

setup_blas()  # route MLX's CPU matmuls to OpenBLAS before anything imports MLX


def _list(text: str | None, cast=str):
    return None if text is None else [cast(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    from mlxkv.bench import gpu
    from mlxkv.errors import UserError

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, contexts 256,1024")
    ap.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    ap.add_argument("--contexts", help="comma-separated token counts (default 4096,32768,131072)")
    ap.add_argument("--policies", help=f"comma-separated, of {','.join(gpu.POLICIES)}")
    ap.add_argument("--weights", help="comma-separated, of bf16,q4 (default both)")
    ap.add_argument("--decode", type=int, help="decode tokens per run (default 32; quick 4)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 2; quick 1)")
    ap.add_argument("--budget", type=float, help="seconds after which no row starts")
    ap.add_argument(
        "--sink-chunk",
        help="tokens per prefill call into a sink cache once it evicts, comma-separated: "
        "each sink row runs once per size (default: the engine's 64)",
    )
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.json (after every row)")
    args = ap.parse_args(argv)
    try:
        contexts = _list(args.contexts, int)
    except ValueError:
        print("gpu_bench: --contexts takes token counts like 4096,32768", file=sys.stderr)
        return 2
    try:
        sink_chunks = _list(args.sink_chunk, int)
    except ValueError:
        print("gpu_bench: --sink-chunk takes token counts like 64,512", file=sys.stderr)
        return 2
    try:
        s = gpu.settings(
            args.quick,
            contexts,
            _list(args.policies),
            _list(args.weights),
            args.device,
            args.decode,
            args.rounds,
            args.budget,
            sink_chunks,
        )
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
        result = gpu.run(
            s,
            log=lambda line: print(line, file=sys.stderr, flush=True),
            progress=(lambda r: write(r, args.out)) if args.out else None,
        )
    except UserError as e:
        print(f"gpu_bench: {e}", file=sys.stderr)
        return 2
    print(gpu.markdown(result), end="")
    if args.out:
        write(result, args.out)
    return 0


def write(result: dict, out: Path) -> None:
    """OUT.md and OUT.json: the files this benchmark creates, rewritten as rows finish."""
    from mlxkv.bench import gpu

    out.with_suffix(".md").write_text(gpu.markdown(result))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    atexit.register(free_streams)  # an abort at exit would stop the commands chained after it
    sys.exit(main())
