"""``mlxkv serve`` vs ``mlx_lm.server``: 1, 4 and 16 concurrent clients, interleaved.

    python benchmarks/serve_bench.py [--clients 1,4,16] [--requests-per-client 1]
        [--max-tokens 64] [--rounds 1] [--workdir DIR] [--json OUT.json]

Both servers load the same float32 copy of the default model (made once in the work
folder) and are driven through the ``openai`` client; see ``mlxkv/bench/serve.py`` for
what is measured. Prints one JSON line per turn, then a Markdown table of medians.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # the float32 copy is made with MLX in this process


def main() -> None:
    from mlxkv.bench.serve import run, table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,4,16", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=16, help="mlxkv serve --max-batch")
    p.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlxkv-serve-bench"
    )
    p.add_argument("--json", type=Path, default=None, help="write every turn here")
    args = p.parse_args()
    turns = run(
        args.workdir,
        clients=tuple(int(c) for c in args.clients.split(",")),
        requests_per_client=args.requests_per_client,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        max_batch=args.max_batch,
    )
    if args.json:
        args.json.write_text(json.dumps(turns, indent=1))
    print(table(turns))


if __name__ == "__main__":
    main()
