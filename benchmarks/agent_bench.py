"""An agent workload against ``mlxkv serve`` and ``mlx_lm.server``, interleaved.

    python benchmarks/agent_bench.py [--conversations 8] [--turns 10] [--start 2000]
        [--step 200] [--max-tokens 16] [--rounds 1] [--budgets room,tight] [--no-disk]
        [--corpus ../shared/data/austen.txt] [--workdir DIR] [--json OUT.json]

See ``mlxkv/bench/agent.py`` for the workload and what is measured. Prints one JSON line
per run, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # the float32 copy is made with MLX in this process


def main() -> None:
    from mlxkv.bench.agent import run, table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--start", type=int, default=2000, help="tokens of each system prompt")
    p.add_argument("--step", type=int, default=200, help="tokens of tool output per turn")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--budgets", default="room,tight")
    p.add_argument(
        "--no-disk", action="store_true", help="mlxkv's memory tier alone in the tight run"
    )
    here = Path(__file__).resolve().parents[1]
    p.add_argument("--corpus", type=Path, default=here.parent / "shared" / "data" / "austen.txt")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlxkv-agent")
    p.add_argument("--json", type=Path, default=None, help="write every run here")
    args = p.parse_args()
    results = run(
        args.workdir,
        args.corpus,
        conversations=args.conversations,
        turns=args.turns,
        start=args.start,
        step=args.step,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        budgets=tuple(args.budgets.split(",")),
        disk=not args.no_disk,
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
